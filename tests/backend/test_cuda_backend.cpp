// The CUDA backend against the CPU reference (backend/cpu/cpu_backend.cpp): every op on random
// inputs and the caching allocator's accounting and out-of-memory message (a whole GPT-2 model
// and the flash-attention kernels: tests/backend/test_cuda_model.cpp).
//
// Each op runs twice, as a parameterized test: with make_cuda_backend(0, kF32) (tight
// tolerances: the two backends then differ only in summation order and FMA contraction) and with
// make_cuda_backend(0, kBF16) (loose tolerances: every stored result is rounded to bf16, 8
// significant bits, relative error up to 2^-9 ≈ 0.2% per rounding). In bf16 mode the inputs are
// rounded to bf16 first (on the GPU, by convert()) and the CPU computes from the same rounded
// values, so only the GPU's own roundings separate the results.
//
// Only the Backend interface is used (no CUDA headers), so this file builds without CUDA too;
// every test skips when cuda_available() is false (CPU-only builds, machines without a GPU).
// Dropout: the same ops with a Dropout, whose masks (core/philox.h) are identical on both
// backends, and the whole model with p = 0.1 (materialized and flash attention).
// The op tests construct their backends with SHARDTRAIN_ATTENTION=materialized, so bf16 mode
// covers the materialized attention kernels (cuda_attention.cu); the FlashAttention* tests at the
// end cover the fused kernels (cuda_flash_attention.cu), the default in bf16/fp16.
#include "app/error_report.h"
#include "cuda_test_support.h"

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpTest, ::testing::Values(DType::kF32, DType::kBF16),
                         dtype_param_name);

// ==== construction and identity ================================================================

TEST_F(CudaBackendTest, Identity) {
  EXPECT_EQ(gpu->kind(), DeviceKind::kCUDA);
  EXPECT_EQ(gpu->compute_dtype(), DType::kF32);
  EXPECT_NE(gpu->description().find("cuda:0"), std::string::npos) << gpu->description();
  EXPECT_TRUE(gpu->attention_saves_probs(64)) << "fp32 always uses the materialized kernels";
  EXPECT_EQ(gpu->attention_probs_dtype(), DType::kF32);
  auto b16 = make_cuda_backend(0);  // default: bf16
  EXPECT_EQ(b16->compute_dtype(), DType::kBF16);
  EXPECT_EQ(b16->attention_probs_dtype(), DType::kBF16);
  EXPECT_EQ(make_cuda_backend(0, DType::kF16)->compute_dtype(), DType::kF16);
}

TEST_F(CudaBackendTest, BadDeviceIndexNamesIt) {
  try {
    make_cuda_backend(999);
    FAIL() << "expected RuntimeFailure";
  } catch (const RuntimeFailure& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cuda:999"), std::string::npos) << msg;
    EXPECT_NE(msg.find("visible"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_cuda_backend(-1), RuntimeFailure);
  EXPECT_THROW(make_cuda_backend(0, DType::kI32), Error);
}

// ==== caching allocator =========================================================================

TEST_F(CudaBackendTest, AllocatorAccountingAndReuse) {
  const size_t base = gpu->allocated_bytes();
  EXPECT_GE(gpu->peak_allocated_bytes(), base);

  // Small request: accounted as at least the request, at most twice its rounded size.
  void* a = gpu->allocate(1000);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_GE(gpu->allocated_bytes(), base + 1000);
  EXPECT_LE(gpu->allocated_bytes(), base + 2048);
  gpu->deallocate(a);
  EXPECT_EQ(gpu->allocated_bytes(), base);

  // Large request: allocated counts the request rounded to 512 B (as PyTorch's
  // memory_allocated), reserved the 2 MiB-rounded block. Peak follows, and stays after the free
  // until reset_peak_memory().
  const size_t big = (size_t{5} << 20) + 123, reserved_before = gpu->reserved_bytes();
  void* b = gpu->allocate(big);
  const size_t with_b = gpu->allocated_bytes();
  EXPECT_EQ(with_b, base + (big + 511) / 512 * 512);
  EXPECT_GE(gpu->reserved_bytes(), reserved_before + (size_t{6} << 20));
  EXPECT_GE(gpu->peak_allocated_bytes(), with_b);
  // Write non-zero bytes into it, free it, ask again: the cached block comes back, zero-filled.
  std::vector<float> ones(big / sizeof(float), 1.0f);
  gpu->copy_from_host(b, ones.data(), ones.size() * sizeof(float));
  gpu->deallocate(b);
  EXPECT_EQ(gpu->allocated_bytes(), base);
  EXPECT_GE(gpu->peak_allocated_bytes(), with_b);
  void* c = gpu->allocate(big);
  EXPECT_EQ(c, b) << "a freed block of the same size should be reused";
  std::vector<float> back(ones.size(), -1.0f);
  gpu->copy_to_host(back.data(), c, back.size() * sizeof(float));
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](float x) { return x == 0.0f; }))
      << "allocate() must return zero-filled memory, also when reusing a block";
  gpu->deallocate(c);
  gpu->reset_peak_memory();
  EXPECT_EQ(gpu->peak_allocated_bytes(), gpu->allocated_bytes());

  // Zero-byte allocations are valid, distinct and freeable.
  void* z1 = gpu->allocate(0);
  void* z2 = gpu->allocate(0);
  EXPECT_NE(z1, nullptr);
  EXPECT_NE(z1, z2);
  gpu->deallocate(z1);
  gpu->deallocate(z2);
  gpu->deallocate(nullptr);

  // Many buffers of mixed sizes, freed in another order: back to the baseline.
  std::vector<void*> ptrs;
  for (int i = 0; i < 40; ++i) ptrs.push_back(gpu->allocate(static_cast<size_t>(i) * 77777 + 1));
  for (int i = 0; i < 40; i += 2) gpu->deallocate(ptrs[static_cast<size_t>(i)]);
  for (int i = 1; i < 40; i += 2) gpu->deallocate(ptrs[static_cast<size_t>(i)]);
  EXPECT_EQ(gpu->allocated_bytes(), base);
}

// A graph's temporaries are reserved, not allocated, between replays (as in PyTorch's private
// graph pools); a replay raises the peak allocated by what they held at the capture's peak.
TEST_F(CudaBackendTest, GraphTemporariesAccounting) {
  const size_t base = gpu->allocated_bytes(), reserved_before = gpu->reserved_bytes();
  const size_t t1 = size_t{3} << 20, t2 = size_t{1} << 20, kept_bytes = 4096;
  void* kept = nullptr;
  std::unique_ptr<Backend::Graph> graph = gpu->capture([&] {
    void* a = gpu->allocate_uninitialized(t1);
    void* b = gpu->allocate_uninitialized(t2);
    gpu->deallocate(a);
    gpu->deallocate(b);
    kept = gpu->allocate_uninitialized(kept_bytes);
    gpu->fill_zero(Tensor(kept, DType::kF32, DeviceKind::kCUDA, {1024}));
  });
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(gpu->allocated_bytes(), base + kept_bytes);
  EXPECT_GE(gpu->reserved_bytes(), reserved_before + t1 + t2) << "the temporaries stay reserved";
  gpu->reset_peak_memory();
  EXPECT_EQ(gpu->peak_allocated_bytes(), base + kept_bytes);
  graph->replay();
  gpu->synchronize();
  EXPECT_EQ(gpu->peak_allocated_bytes(), base + t1 + t2);
  EXPECT_EQ(gpu->allocated_bytes(), base + kept_bytes);
  graph.reset();
  gpu->deallocate(kept);
  EXPECT_EQ(gpu->allocated_bytes(), base);
}

TEST_F(CudaBackendTest, OutOfMemoryMessageNamesSizeAndRemedy) {
  const size_t base = gpu->allocated_bytes();
  // Something cached first, so the free-the-cache-and-retry path runs too.
  gpu->deallocate(gpu->allocate(size_t{64} << 20));
  const size_t pib = size_t{1} << 50;
  try {
    gpu->allocate(pib);
    FAIL() << "allocating 1 PiB should fail";
  } catch (const OutOfMemory& e) {
    // What the user reads: the allocator's facts, and the remedy the command line adds.
    EXPECT_EQ(e.memory(), Memory::kGpu);
    const std::string msg = classify_exception(std::current_exception()).message;
    EXPECT_NE(msg.find("1125899906842624"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1.00 PiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--batch-size"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--activation-checkpointing"), std::string::npos) << msg;
    EXPECT_NE(msg.find("zero"), std::string::npos) << msg;
  }
  EXPECT_EQ(gpu->allocated_bytes(), base);
  // The backend is still usable (the failed cudaMalloc left no pending error behind).
  FlatBuffer x = upload(*gpu, {1.0f, 2.0f, 3.0f}, DType::kF32);
  EXPECT_EQ(gpu->sum_squares(x.view()), 14.0);
}

// ==== copies and conversion ======================================================================

TEST_F(CudaBackendTest, CopiesAndFillZero) {
  std::vector<float> h = randu(1001, 1);
  FlatBuffer a = upload(*gpu, h, DType::kF32);
  FlatBuffer b(*gpu, DType::kF32, 1001);
  gpu->copy(b.data(), a.data(), a.bytes());
  EXPECT_TRUE(bit_equal(download(*gpu, b), h));
  gpu->fill_zero(a.slice(10, 20));
  std::vector<float> want = h;
  std::fill(want.begin() + 10, want.begin() + 30, 0.0f);
  EXPECT_TRUE(bit_equal(download(*gpu, a), want));
  gpu->synchronize();
}

TEST_F(CudaBackendTest, ConvertRoundsToNearestEven) {
  // Random values plus exact ties (low 16 bits 0x8000: half-way between two bf16 values), both
  // even and odd kept mantissas, signed, and specials.
  std::vector<float> h = randu(4093, 2, 100.0f);
  for (uint32_t m = 0; m < 64; ++m) {
    const uint32_t bits = 0x3F800000u | (m << 16) | 0x8000u;
    float f;
    std::memcpy(&f, &bits, 4);
    h.push_back(f);
    h.push_back(-f);
  }
  h.push_back(INFINITY);
  h.push_back(-INFINITY);
  h.push_back(NAN);
  h.push_back(0.0f);
  h.push_back(-0.0f);
  h.push_back(1e-40f);  // subnormal
  const auto n = static_cast<int64_t>(h.size());
  FlatBuffer src = upload(*gpu, h, DType::kF32);

  // fp32 -> bf16 -> fp32: exactly the host RNE reference.
  FlatBuffer b16(*gpu, DType::kBF16, n);
  gpu->convert(b16.view(), src.view());
  std::vector<float> got = download(*gpu, b16);
  for (size_t i = 0; i < h.size(); ++i) {
    const float want = round_bf16(h[i]);
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got[i])) << i;
    else
      ASSERT_EQ(got[i], want) << "element " << i << " (" << h[i] << ")";
  }

  // fp32 -> fp16 -> fp32: relative error ≤ 2^-11 in fp16's normal range.
  FlatBuffer f16(*gpu, DType::kF16, n);
  gpu->convert(f16.view(), src.view());
  std::vector<float> half = download(*gpu, f16);
  for (size_t i = 0; i < h.size(); ++i) {
    const float x = h[i];
    if (std::isfinite(x) && std::fabs(x) >= 6.2e-5f && std::fabs(x) <= 65504.0f) {
      EXPECT_LE(std::fabs(half[i] - x), std::ldexp(std::fabs(x), -11)) << i;
    }
  }
  EXPECT_TRUE(std::isnan(half[h.size() - 4]));

  // bf16 -> fp16 -> bf16 on misaligned, odd-length slices (the scalar path): bf16 values with
  // |x| in [2^-14, 2^15] and 8 significant bits are exact in fp16, so the round trip is exact.
  std::vector<float> small = randu(1003, 3, 50.0f);
  for (auto& x : small) x = round_bf16(x);
  FlatBuffer s32 = upload(*gpu, small, DType::kF32);
  FlatBuffer s16(*gpu, DType::kBF16, 1003), h16(*gpu, DType::kF16, 1003),
      r16(*gpu, DType::kBF16, 1003);
  gpu->convert(s16.view(), s32.view());
  gpu->convert(h16.slice(1, 1001), s16.slice(1, 1001));
  gpu->convert(r16.slice(1, 1001), h16.slice(1, 1001));
  std::vector<float> rt = download(*gpu, r16);
  for (size_t i = 1; i < 1002; ++i)
    if (std::fabs(small[i]) >= 6.2e-5f) {
      EXPECT_EQ(rt[i], small[i]) << i;
    }
  EXPECT_EQ(rt[0], 0.0f);
  EXPECT_EQ(rt[1002], 0.0f);

  // Same dtype: a copy.
  FlatBuffer copy(*gpu, DType::kF32, n);
  gpu->convert(copy.view(), src.view());
  EXPECT_TRUE(bit_equal(download(*gpu, copy), download(*gpu, src)));
}

// ==== elementwise ops ============================================================================

TEST_P(CudaOpTest, GeluForwardBackwardAddScale) {
  // 4099: not a multiple of the vector width (tail); slices at offset 3: the unaligned path.
  const int64_t n = 4099;
  for (int64_t off : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(off ? "unaligned slices" : "aligned");
    const int64_t m = n - off;
    auto x = rounded(randu(n, 10, 4.0f)), dy = rounded(randu(n, 11)), y2 = rounded(randu(n, 12));
    FlatBuffer gx = up(x), gdy = up(dy), gy2 = up(y2), gout(*gpu, dt(), n), gdx(*gpu, dt(), n);
    auto slice = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + off, v.end());
    };
    auto xs = slice(x), dys = slice(dy), y2s = slice(y2);
    std::vector<float> out(static_cast<size_t>(m)), dx(static_cast<size_t>(m));

    // GELU: fp32 1e-5 relative plus 1e-6·max absolute (tanhf vs std::tanh, ~2 ulp).
    gpu->gelu_forward(gout.slice(off, m), gx.slice(off, m));
    cpu->gelu_forward(host(out, {m}), host(xs, {m}));
    expect_close(slice(down(gout)), out, rtol(1e-5), atol(1e-6), "gelu_forward");
    gpu->gelu_backward(gdx.slice(off, m), gx.slice(off, m), gdy.slice(off, m));
    cpu->gelu_backward(host(dx, {m}), host(xs, {m}), host(dys, {m}));
    expect_close(slice(down(gdx)), dx, rtol(1e-5), atol(1e-6), "gelu_backward");
    // In place, as matmul_backward uses it: dinp aliases dout.
    gpu->gelu_backward(gdy.slice(off, m), gx.slice(off, m), gdy.slice(off, m));
    expect_close(slice(down(gdy)), dx, rtol(1e-5), atol(1e-6), "gelu_backward in place");

    // add, also with out aliasing an input: one rounding, fp32 exact.
    gpu->add(gout.slice(off, m), gx.slice(off, m), gy2.slice(off, m));
    cpu->add(host(out, {m}), host(xs, {m}), host(y2s, {m}));
    expect_close(slice(down(gout)), out, rtol(1e-7), atol(0), "add");
    gpu->add(gx.slice(off, m), gx.slice(off, m), gy2.slice(off, m));
    expect_close(slice(down(gx)), out, rtol(1e-7), atol(0), "add in place");

    // scale: one multiplication, fp32 exact.
    gpu->scale(gy2.slice(off, m), -0.37f);
    cpu->scale(host(y2s, {m}), -0.37f);
    auto gy2_h = down(gy2);
    expect_close(slice(gy2_h), y2s, rtol(1e-7), atol(0), "scale");
    // Elements before the slice are untouched.
    if (off) {
      EXPECT_EQ(gy2_h[0], y2[0]);
    }
  }
}

// ==== blockwise int8 quantization (ZeRO++'s qgZ)
// ==================================================

// The CPU backend's: each element within half a quantization step of its block (max |x| / 127),
// an all-zero block exactly zero, and dequantize_add adding onto what is there.
TEST(CpuQuantize, Int8BlocksRoundTrip) {
  auto cpu = make_cpu_backend();
  const int64_t n = 3 * kQuantBlock + 17;  // a short last block
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[static_cast<size_t>(i)] = i < kQuantBlock ? 0.0f : std::sin(0.37f * i) * (1 + i % 7);
  const int64_t blocks = 4;
  std::vector<uint8_t> q(static_cast<size_t>(n));
  std::vector<float> scales(static_cast<size_t>(blocks)), back(static_cast<size_t>(n), 1.0f);
  cpu->quantize_int8(Tensor(q.data(), DType::kU8, DeviceKind::kCPU, {n}),
                     Tensor(scales.data(), DType::kF32, DeviceKind::kCPU, {blocks}),
                     Tensor(x.data(), DType::kF32, DeviceKind::kCPU, {n}));
  cpu->dequantize_add_int8(Tensor(back.data(), DType::kF32, DeviceKind::kCPU, {n}),
                           Tensor(q.data(), DType::kU8, DeviceKind::kCPU, {n}),
                           Tensor(scales.data(), DType::kF32, DeviceKind::kCPU, {blocks}));
  EXPECT_EQ(scales[0], 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float s = scales[static_cast<size_t>(i / kQuantBlock)];
    EXPECT_LE(std::fabs(back[static_cast<size_t>(i)] - 1.0f - x[static_cast<size_t>(i)]),
              0.5f * s + 1e-6f)
        << i;
  }
}

// The CUDA kernels give the CPU's codes and scales for the same values (division, round to
// nearest even, on both) and the same dequantized sums.
TEST_P(CudaOpTest, QuantizeInt8MatchesCpu) {
  const int64_t n = 5 * kQuantBlock + 99, blocks = 6;
  const auto x = rounded(randu(n, 21, 3.0f)), acc = rounded(randu(n, 22));
  FlatBuffer gx = up(x), gacc = up(acc), gq(*gpu, DType::kU8, n), gs(*gpu, DType::kF32, blocks);
  gpu->quantize_int8(gq.view(), gs.view(), gx.view());
  gpu->dequantize_add_int8(gacc.view(), gq.view(), gs.view());
  std::vector<float> xs = x, out = acc, scales(static_cast<size_t>(blocks));
  std::vector<uint8_t> q(static_cast<size_t>(n));
  cpu->quantize_int8(Tensor(q.data(), DType::kU8, DeviceKind::kCPU, {n}), host(scales, {blocks}),
                     host(xs, {n}));
  cpu->dequantize_add_int8(host(out, {n}), Tensor(q.data(), DType::kU8, DeviceKind::kCPU, {n}),
                           host(scales, {blocks}));
  std::vector<uint8_t> gq_h(static_cast<size_t>(n));
  std::vector<float> gs_h(static_cast<size_t>(blocks));
  gpu->copy_to_host(gq_h.data(), gq.data(), gq_h.size());
  gpu->copy_to_host(gs_h.data(), gs.data(), gs_h.size() * sizeof(float));
  EXPECT_EQ(gq_h, q);
  EXPECT_EQ(gs_h, scales);
  expect_close(down(gacc), out, rtol(1e-6), atol(1e-6), "dequantize_add_int8");
}

// ==== embedding ==================================================================================

TEST_P(CudaOpTest, EmbeddingForwardBackwardRepeatedTokensDeterministic) {
  struct Case {
    int64_t V, C;
  };
  // Small vocabulary (many repeats; C a multiple of 8: vector path) and GPT-2's vocabulary with
  // C = 50 (scalar path).
  for (const Case& cs : {Case{37, 96}, Case{50257, 50}}) {
    SCOPED_TRACE("V=" + std::to_string(cs.V) + " C=" + std::to_string(cs.C));
    const int64_t B = 4, Tn = 64, maxT = Tn + 3, V = cs.V, C = cs.C, N = B * Tn;
    auto tok =
        randi(static_cast<size_t>(N), 20 + static_cast<uint64_t>(V), static_cast<int32_t>(V));
    for (int64_t t = 0; t < Tn; ++t)
      tok[static_cast<size_t>(3 * Tn + t)] = static_cast<int32_t>(V - 1);  // a long run
    tok[0] = 0;
    auto wte = rounded(randu(static_cast<size_t>(V * C), 21)),
         wpe = rounded(randu(static_cast<size_t>(maxT * C), 22)),
         dout = rounded(randu(static_cast<size_t>(N * C), 23)),
         dwte0 = rounded(randu(static_cast<size_t>(V * C), 24, 0.5f)),
         dwpe0 = rounded(randu(static_cast<size_t>(maxT * C), 25, 0.5f));
    FlatBuffer gtok = upload_i32(*gpu, tok), gwte = up(wte), gwpe = up(wpe), gdout = up(dout),
               gout(*gpu, dt(), N * C);

    std::vector<float> out(static_cast<size_t>(N * C));
    gpu->embedding_forward(dev(gout, {B, Tn, C}), dev(gtok, {B, Tn}), dev(gwte, {V, C}),
                           dev(gwpe, {maxT, C}));
    cpu->embedding_forward(host(out, {B, Tn, C}), host_i32(tok, {B, Tn}), host(wte, {V, C}),
                           host(wpe, {maxT, C}));
    expect_close(down(gout), out, rtol(1e-7), atol(0), "embedding_forward");

    // Backward accumulates into pre-filled gradients. fp32: sums of up to 64 rows in another
    // order, 1e-5 relative plus 1e-6·max absolute.
    std::vector<float> dwte = dwte0, dwpe = dwpe0;
    cpu->embedding_backward(host(dwte, {V, C}), host(dwpe, {maxT, C}), host(dout, {B, Tn, C}),
                            host_i32(tok, {B, Tn}));
    std::vector<float> first_wte, first_wpe;
    for (int run = 0; run < 2; ++run) {
      FlatBuffer gdwte = up(dwte0), gdwpe = up(dwpe0);
      gpu->embedding_backward(dev(gdwte, {V, C}), dev(gdwpe, {maxT, C}), dev(gdout, {B, Tn, C}),
                              dev(gtok, {B, Tn}));
      auto got_wte = down(gdwte), got_wpe = down(gdwpe);
      if (run == 0) {
        expect_close(got_wte, dwte, rtol(1e-5), atol(1e-6), "embedding_backward dwte");
        expect_close(got_wpe, dwpe, rtol(1e-5), atol(1e-6), "embedding_backward dwpe");
        first_wte = got_wte;
        first_wpe = got_wpe;
      } else {
        EXPECT_TRUE(bit_equal(got_wte, first_wte)) << "dwte differs between two identical runs";
        EXPECT_TRUE(bit_equal(got_wpe, first_wpe)) << "dwpe differs between two identical runs";
      }
    }
    // Either part alone (an empty gradient skips the other): the same kernels, the same bits
    // (the tied-embedding hand-off runs wpe's part alone and wte's on every rank's rows).
    FlatBuffer gdwte = up(dwte0), gdwpe = up(dwpe0);
    gpu->embedding_backward(dev(gdwte, {V, C}), Tensor(), dev(gdout, {B, Tn, C}),
                            dev(gtok, {B, Tn}));
    gpu->embedding_backward(Tensor(), dev(gdwpe, {maxT, C}), dev(gdout, {B, Tn, C}),
                            dev(gtok, {B, Tn}));
    EXPECT_TRUE(bit_equal(down(gdwte), first_wte)) << "dwte alone";
    EXPECT_TRUE(bit_equal(down(gdwpe), first_wpe)) << "dwpe alone";
  }
}

// ==== dropout (core/philox.h): the GPU draws the CPU reference's masks ==========================
// The masks are an exact function of (seed, site, element index) on both backends, so the
// results differ only by the GPU's roundings: the same tolerances as without dropout.

namespace {

Dropout test_dropout(float p, uint64_t seed, uint32_t site) {
  Dropout d;
  d.p = p;
  d.seed = seed;
  d.site = site;
  return d;
}

}  // namespace

// add with a dropped second operand and dropout_backward, aligned (vector path, a tail) and at
// offset 3 (scalar path); the mask of a slice is that of its own element indices 0..m-1.
TEST_P(CudaOpTest, DropoutAddAndBackwardMatchCpu) {
  const int64_t n = 4099;
  const Dropout d = test_dropout(0.3f, 0xABCDEF12345ull, 9);
  for (int64_t off : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(off ? "unaligned slices" : "aligned");
    const int64_t m = n - off;
    auto a = rounded(randu(n, 15)), b = rounded(randu(n, 16));
    FlatBuffer ga = up(a), gb = up(b), gout(*gpu, dt(), n), gd(*gpu, dt(), n);
    auto slice = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + off, v.end());
    };
    auto as = slice(a), bs = slice(b);
    std::vector<float> out(static_cast<size_t>(m)), db(static_cast<size_t>(m));
    gpu->add(gout.slice(off, m), ga.slice(off, m), gb.slice(off, m), d);
    cpu->add(host(out, {m}), host(as, {m}), host(bs, {m}), d);
    // fp32: a + b·scale in one FMA on the GPU: 1e-6 relative plus 1e-6·max absolute.
    expect_close(slice(down(gout)), out, rtol(1e-6), atol(1e-6), "add with dropout");
    gpu->dropout_backward(gd.slice(off, m), gb.slice(off, m), d);
    cpu->dropout_backward(host(db, {m}), host(bs, {m}), d);
    const auto got = slice(down(gd));
    expect_close(got, db, rtol(1e-6), atol(0), "dropout_backward");
    // The same elements are zero on both sides (the masks agree exactly).
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i] == 0.f, db[i] == 0.f) << "mask differs at element " << i;
    // In place (dst aliases src).
    gpu->dropout_backward(gb.slice(off, m), gb.slice(off, m), d);
    expect_close(slice(down(gb)), db, rtol(1e-6), atol(0), "dropout_backward in place");
  }
}

TEST_P(CudaOpTest, EmbeddingWithDropoutMatchesCpu) {
  struct Case {
    int64_t V, C;
  };
  for (const Case& cs : {Case{37, 96}, Case{50257, 50}}) {
    SCOPED_TRACE("V=" + std::to_string(cs.V) + " C=" + std::to_string(cs.C));
    const int64_t B = 4, Tn = 64, maxT = Tn + 3, V = cs.V, C = cs.C, N = B * Tn;
    const Dropout d = test_dropout(0.1f, 77, 0);
    auto tok =
        randi(static_cast<size_t>(N), 30 + static_cast<uint64_t>(V), static_cast<int32_t>(V));
    for (int64_t t = 0; t < Tn; ++t) tok[static_cast<size_t>(3 * Tn + t)] = 1;  // a long run
    auto wte = rounded(randu(static_cast<size_t>(V * C), 31)),
         wpe = rounded(randu(static_cast<size_t>(maxT * C), 32)),
         dout = rounded(randu(static_cast<size_t>(N * C), 33));
    FlatBuffer gtok = upload_i32(*gpu, tok), gwte = up(wte), gwpe = up(wpe), gdout = up(dout),
               gout(*gpu, dt(), N * C);
    std::vector<float> out(static_cast<size_t>(N * C));
    gpu->embedding_forward(dev(gout, {B, Tn, C}), dev(gtok, {B, Tn}), dev(gwte, {V, C}),
                           dev(gwpe, {maxT, C}), d);
    cpu->embedding_forward(host(out, {B, Tn, C}), host_i32(tok, {B, Tn}), host(wte, {V, C}),
                           host(wpe, {maxT, C}), d);
    expect_close(down(gout), out, rtol(1e-6), atol(0), "embedding_forward with dropout");
    std::vector<float> dwte(static_cast<size_t>(V * C), 0.f),
        dwpe(static_cast<size_t>(maxT * C), 0.f);
    cpu->embedding_backward(host(dwte, {V, C}), host(dwpe, {maxT, C}), host(dout, {B, Tn, C}),
                            host_i32(tok, {B, Tn}), d);
    FlatBuffer gdwte(*gpu, dt(), V * C), gdwpe(*gpu, dt(), maxT * C);
    gpu->embedding_backward(dev(gdwte, {V, C}), dev(gdwpe, {maxT, C}), dev(gdout, {B, Tn, C}),
                            dev(gtok, {B, Tn}), d);
    expect_close(down(gdwte), dwte, rtol(1e-5), atol(1e-6), "embedding_backward dwte with dropout");
    expect_close(down(gdwpe), dwpe, rtol(1e-5), atol(1e-6), "embedding_backward dwpe with dropout");
  }
}

// ==== layernorm ==================================================================================

TEST_P(CudaOpTest, LayerNormForwardBackward) {
  struct Case {
    int64_t N, C;
  };
  // C = 768 (GPT-2, vector path), C = 100 (not a multiple of 8 or 32: scalar path), and many
  // rows (several row groups in the parameter-gradient reduction, with R > 32 rows per group).
  for (const Case& cs : {Case{37, 768}, Case{1100, 100}, Case{40000, 8}}) {
    SCOPED_TRACE("N=" + std::to_string(cs.N) + " C=" + std::to_string(cs.C));
    const int64_t N = cs.N, C = cs.C;
    const auto NC = static_cast<size_t>(N * C), Cs = static_cast<size_t>(C);
    auto x = rounded(randu(NC, 30, 2.0f, 0.5f)), w = rounded(randu(Cs, 31, 0.5f, 1.0f)),
         b = rounded(randu(Cs, 32, 0.2f)), dy = rounded(randu(NC, 33)),
         dx0 = rounded(randu(NC, 34)), dw0 = rounded(randu(Cs, 35)), db0 = rounded(randu(Cs, 36));
    FlatBuffer gx = up(x), gw = up(w), gb = up(b), gdy = up(dy), gy(*gpu, dt(), N * C),
               gmean(*gpu, DType::kF32, N), grstd(*gpu, DType::kF32, N);
    std::vector<float> y(NC), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
    gpu->layernorm_forward(dev(gy, {N, C}), dev(gmean, {N}), dev(grstd, {N}), dev(gx, {N, C}),
                           dev(gw, {C}), dev(gb, {C}));
    cpu->layernorm_forward(host(y, {N, C}), host(mean, {N}), host(rstd, {N}), host(x, {N, C}),
                           host(w, {C}), host(b, {C}));
    // Statistics are fp32 from identical inputs in both modes: 1e-5.
    expect_close(down(gmean), mean, 1e-5, 1e-5, "layernorm mean");
    expect_close(down(grstd), rstd, 1e-5, 0, "layernorm rstd");
    expect_close(down(gy), y, rtol(1e-5), atol(1e-6), "layernorm out");

    // Backward: dinp, dweight, dbias all accumulate into pre-filled values.
    std::vector<float> dx = dx0, dw = dw0, db = db0;
    cpu->layernorm_backward(host(dx, {N, C}), host(dw, {C}), host(db, {C}), host(dy, {N, C}),
                            host(x, {N, C}), host(w, {C}), host(mean, {N}), host(rstd, {N}));
    FlatBuffer gdx = up(dx0), gdw = up(dw0), gdb = up(db0);
    // The GPU's own statistics (fp32) are what it saved; they match the CPU's to 1e-5.
    gpu->layernorm_backward(dev(gdx, {N, C}), dev(gdw, {C}), dev(gdb, {C}), dev(gdy, {N, C}),
                            dev(gx, {N, C}), dev(gw, {C}), dev(gmean, {N}), dev(grstd, {N}));
    expect_close(down(gdx), dx, rtol(1e-5), atol(1e-5), "layernorm dinp");
    // Parameter gradients sum N rows: 1e-5 relative plus 1e-5·max absolute in fp32.
    expect_close(down(gdw), dw, rtol(1e-5), atol(1e-5), "layernorm dweight");
    expect_close(down(gdb), db, rtol(1e-5), atol(1e-5), "layernorm dbias");

    // Deterministic: a second identical call adds bit-identical amounts.
    FlatBuffer gdw2 = up(dw0), gdb2 = up(db0), gdx2 = up(dx0);
    gpu->layernorm_backward(dev(gdx2, {N, C}), dev(gdw2, {C}), dev(gdb2, {C}), dev(gdy, {N, C}),
                            dev(gx, {N, C}), dev(gw, {C}), dev(gmean, {N}), dev(grstd, {N}));
    EXPECT_TRUE(bit_equal(down(gdw2), down(gdw)));
    EXPECT_TRUE(bit_equal(down(gdb2), down(gdb)));
    EXPECT_TRUE(bit_equal(down(gdx2), down(gdx)));
  }
}

TEST_F(CudaBackendTest, LayerNormBackwardAccumulatesIntoDinp) {
  const int64_t N = 5, C = 64;
  auto x = randu(N * C, 40), w = randu(C, 41, 0.5f, 1.0f), b = randu(C, 42), dy = randu(N * C, 43);
  FlatBuffer gx = upload(*gpu, x, DType::kF32), gw = upload(*gpu, w, DType::kF32),
             gb = upload(*gpu, b, DType::kF32), gdy = upload(*gpu, dy, DType::kF32),
             gy(*gpu, DType::kF32, N * C), gmean(*gpu, DType::kF32, N), grstd(*gpu, DType::kF32, N);
  gpu->layernorm_forward(dev(gy, {N, C}), dev(gmean, {N}), dev(grstd, {N}), dev(gx, {N, C}),
                         dev(gw, {C}), dev(gb, {C}));
  FlatBuffer dx0(*gpu, DType::kF32, N * C),
      dx1 = upload(*gpu, std::vector<float>(N * C, 1.5f), DType::kF32);
  FlatBuffer dw(*gpu, DType::kF32, C), db(*gpu, DType::kF32, C);
  gpu->layernorm_backward(dev(dx0, {N, C}), dev(dw, {C}), dev(db, {C}), dev(gdy, {N, C}),
                          dev(gx, {N, C}), dev(gw, {C}), dev(gmean, {N}), dev(grstd, {N}));
  auto dw1 = download(*gpu, dw), db1 = download(*gpu, db);
  gpu->layernorm_backward(dev(dx1, {N, C}), dev(dw, {C}), dev(db, {C}), dev(gdy, {N, C}),
                          dev(gx, {N, C}), dev(gw, {C}), dev(gmean, {N}), dev(grstd, {N}));
  auto a = download(*gpu, dx0), bb = download(*gpu, dx1), dw2 = download(*gpu, dw),
       db2 = download(*gpu, db);
  // 1.5 + dx is rounded once (fused multiply-add into the accumulator) where a[i] + 1.5 is
  // rounded twice: they may differ by an ulp of 1.5 (1.2e-7).
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(bb[i], a[i] + 1.5f, 2.5e-7) << i;
  // The second call added the same parameter gradients again.
  for (size_t c = 0; c < dw1.size(); ++c) {
    EXPECT_FLOAT_EQ(dw2[c], 2 * dw1[c]) << c;
    EXPECT_FLOAT_EQ(db2[c], 2 * db1[c]) << c;
  }
}

// ==== cross-entropy ==============================================================================

TEST_P(CudaOpTest, SoftmaxCrossEntropyGpt2Vocabulary) {
  // Rows start at every alignment (the kernel reads an unaligned head, 16-byte vectors, a tail);
  // V = 3 is all head.
  for (int64_t V : {int64_t{50257}, int64_t{11}, int64_t{3}}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    const int64_t N = 6;
    std::vector<int32_t> tg = {0,  static_cast<int32_t>(V - 1), -1, static_cast<int32_t>(V / 2),
                               -1, static_cast<int32_t>(V / 3)};
    auto logits = rounded(randu(static_cast<size_t>(N * V), 50 + static_cast<uint64_t>(V), 4.0f));
    if (V > 100)  // masked logits: exp(−∞) = 0
      for (int64_t j : {int64_t{1}, int64_t{17}, V - 2}) logits[static_cast<size_t>(j)] = -INFINITY;
    FlatBuffer gl = up(logits), gt = upload_i32(*gpu, tg), gloss(*gpu, DType::kF32, N),
               gloss2(*gpu, DType::kF32, N);
    const float gs = 0.37f;

    // Forward only: losses, logits untouched (bit for bit).
    std::vector<float> loss_fwd(static_cast<size_t>(N));
    cpu->cross_entropy_forward(host(loss_fwd, {N}), host(logits, {N, V}), host_i32(tg, {N}), V);
    gpu->cross_entropy_forward(dev(gloss2, {N}), dev(gl, {N, V}), dev(gt, {N}), V);
    // Losses are fp32 from identical logits in both modes (summation order, expf): 1e-5.
    expect_close(down(gloss2), loss_fwd, 1e-5, 1e-6, "cross_entropy_forward losses");
    EXPECT_TRUE(bit_equal(down(gl), logits)) << "cross_entropy_forward changed the logits";

    // Fused: losses and ∂L/∂logits = (softmax − onehot)·grad_scale, in place.
    std::vector<float> loss(static_cast<size_t>(N)), dl = logits;
    cpu->softmax_cross_entropy(host(loss, {N}), host(dl, {N, V}), host_i32(tg, {N}), gs, V);
    gpu->softmax_cross_entropy(dev(gloss, {N}), dev(gl, {N, V}), dev(gt, {N}), gs, V);
    auto got_loss = down(gloss), got_dl = down(gl);
    expect_close(got_loss, loss, 1e-5, 1e-6, "softmax_cross_entropy losses");
    // Gradients: every entry positive except the target's; no cancellation, pure relative
    // tolerance (1e-5 in fp32).
    expect_close(got_dl, dl, rtol(1e-5), fp32() ? 1e-7 : 1e-6, "softmax_cross_entropy dlogits");
    for (int64_t i : {int64_t{2}, int64_t{4}}) {  // ignored rows
      EXPECT_EQ(got_loss[static_cast<size_t>(i)], 0.0f);
      for (int64_t j = 0; j < V; ++j)
        ASSERT_EQ(got_dl[static_cast<size_t>(i * V + j)], 0.0f) << "row " << i << " col " << j;
    }
    // Each non-ignored gradient row sums to ~0 (softmax sums to 1).
    for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{5}}) {
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += got_dl[static_cast<size_t>(i * V + j)];
      EXPECT_NEAR(s, 0.0, fp32() ? 1e-5 : 1e-2) << "row " << i;
    }
  }
}

// ==== reductions =================================================================================

TEST_P(CudaOpTest, SumSquaresAndSumDeterministic) {
  const int64_t n = 1000003;
  auto x = rounded(randu(static_cast<size_t>(n), 60, 3.0f, 0.1f));
  FlatBuffer gx = up(x);
  FlatBuffer gx32 = upload(*gpu, x, DType::kF32);
  // Both sum the same values in double, in different orders: 1e-6 relative (in both modes).
  const double want_ss = cpu->sum_squares(host(x, {n}));
  const double got_ss = gpu->sum_squares(gx.view());
  EXPECT_NEAR(got_ss, want_ss, 1e-6 * std::fabs(want_ss));
  EXPECT_EQ(gpu->sum_squares(gx.view()), got_ss) << "sum_squares is not deterministic";
  // Σ x has cancellation: 1e-6 relative to Σ|x|.
  double sum_abs = 0;
  for (float v : x) sum_abs += std::fabs(v);
  const double want_s = cpu->sum(host(x, {n}));
  const double got_s = gpu->sum(gx32.view());
  EXPECT_NEAR(got_s, want_s, 1e-6 * sum_abs);
  EXPECT_EQ(gpu->sum(gx32.view()), got_s) << "sum is not deterministic";
  // Unaligned, odd-length slices; a tiny tensor; an empty slice.
  std::vector<float> xs(x.begin() + 1, x.end() - 1);
  const int64_t m = n - 2;
  EXPECT_NEAR(gpu->sum_squares(gx.slice(1, m)), cpu->sum_squares(host(xs, {m})), 1e-6 * want_ss);
  EXPECT_NEAR(gpu->sum(gx32.slice(1, m)), cpu->sum(host(xs, {m})), 1e-6 * sum_abs);
  std::vector<float> five(x.begin(), x.begin() + 5);
  EXPECT_NEAR(gpu->sum_squares(gx.slice(0, 5)), cpu->sum_squares(host(five, {5})), 1e-12);
  EXPECT_EQ(gpu->sum_squares(gx.slice(7, 0)), 0.0);
  // Non-finite values propagate.
  FlatBuffer bad = upload(*gpu, {1.0f, NAN, 2.0f}, dt());
  EXPECT_TRUE(std::isnan(gpu->sum_squares(bad.view())));
}

// ==== AdamW ======================================================================================

TEST_P(CudaOpTest, AdamWMatchesCpu) {
  const int64_t n = 10001;
  Backend::AdamWArgs a{};
  a.lr = 1e-3f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.grad_scale = 0.5f;
  for (int64_t off : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE(off ? "unaligned slices" : "aligned");
    const int64_t m = n - off;
    auto sl = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + off, v.end());
    };
    auto p = randu(static_cast<size_t>(n), 70, 1.0f);
    auto mm = std::vector<float>(static_cast<size_t>(n), 0.0f), vv = mm;
    FlatBuffer gp = upload(*gpu, p, DType::kF32), gm(*gpu, DType::kF32, n),
               gv(*gpu, DType::kF32, n), gout(*gpu, dt(), n);
    std::vector<float> cp = sl(p), cm = sl(mm), cv = sl(vv);
    for (int t = 1; t <= 3; ++t) {
      a.bias_correction1 = 1.0f - std::pow(a.beta1, static_cast<float>(t));
      a.bias_correction2 = 1.0f - std::pow(a.beta2, static_cast<float>(t));
      auto g = rounded(randu(static_cast<size_t>(n), 71 + static_cast<uint64_t>(t), 2.0f));
      FlatBuffer gg = up(g);
      auto gs = sl(g);
      cpu->adamw(host(cp, {m}), host(gs, {m}), host(cm, {m}), host(cv, {m}), Tensor(), a);
      gpu->adamw(gp.slice(off, m), gg.slice(off, m), gm.slice(off, m), gv.slice(off, m),
                 gout.slice(off, m), a);
    }
    // fp32 arithmetic on both sides (the grad is the same rounded value): 1e-5 relative.
    auto got_p = sl(download(*gpu, gp)), got_m = sl(download(*gpu, gm)),
         got_v = sl(download(*gpu, gv));
    expect_close(got_p, cp, 1e-5, 1e-6, "adamw master");
    expect_close(got_m, cm, 1e-5, 1e-6, "adamw m");
    expect_close(got_v, cv, 1e-5, 1e-6, "adamw v");
    // params_out is the updated master rounded to its dtype, exactly.
    auto got_out = sl(down(gout));
    for (size_t i = 0; i < got_out.size(); ++i) {
      const float want = fp32() ? got_p[i] : round_bf16(got_p[i]);
      ASSERT_EQ(got_out[i], want) << "params_out element " << i;
    }
  }
}

// adamw_runs is adamw per run, bit for bit: runs of any length (not multiples of the vector
// width, so chunks straddle runs), more runs than one launch takes, aligned or not.
TEST_P(CudaOpTest, AdamWRunsIsAdamWPerRun) {
  Backend::AdamWArgs a{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.1f, 0.05f};
  std::vector<Backend::AdamWRun> runs;
  int64_t n = 0;
  for (int r = 0; r < 1100; ++r) {  // 1100 > cuda::kAdamWRunsPerLaunch runs
    const int64_t len = r % 7 == 0 ? 1 + (r * 37) % 3001 : 8 + (r % 5);
    runs.push_back({n, len, r % 3 != 1});
    n += len;
  }
  for (int64_t off : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(off ? "unaligned" : "aligned");
    auto p = randu(static_cast<size_t>(n + off), 90, 1.0f);
    auto g = rounded(randu(static_cast<size_t>(n + off), 91, 2.0f));
    auto mv = randu(static_cast<size_t>(n + off), 92, 0.1f);
    auto vv = randu(static_cast<size_t>(n + off), 93, 0.01f);
    for (float& x : vv) x = std::fabs(x);
    FlatBuffer p1 = upload(*gpu, p, DType::kF32), p2 = upload(*gpu, p, DType::kF32), gg = up(g),
               m1 = upload(*gpu, mv, DType::kF32), m2 = upload(*gpu, mv, DType::kF32),
               v1 = upload(*gpu, vv, DType::kF32), v2 = upload(*gpu, vv, DType::kF32),
               o1(*gpu, dt(), n + off), o2(*gpu, dt(), n + off);
    const auto at = [&](FlatBuffer& b, int64_t begin, int64_t count) {
      return b.slice(off + begin, count);
    };
    for (const Backend::AdamWRun& r : runs) {
      Backend::AdamWArgs ar = a;
      ar.weight_decay = r.decay ? a.weight_decay : 0.0f;
      gpu->adamw(at(p1, r.begin, r.count), at(gg, r.begin, r.count), at(m1, r.begin, r.count),
                 at(v1, r.begin, r.count), at(o1, r.begin, r.count), ar);
    }
    gpu->adamw_runs(at(p2, 0, n), at(gg, 0, n), at(m2, 0, n), at(v2, 0, n), at(o2, 0, n), runs, a);
    EXPECT_TRUE(bit_equal(download(*gpu, p2), download(*gpu, p1))) << "master";
    EXPECT_TRUE(bit_equal(download(*gpu, m2), download(*gpu, m1))) << "m";
    EXPECT_TRUE(bit_equal(download(*gpu, v2), download(*gpu, v1))) << "v";
    EXPECT_TRUE(bit_equal(down(o2), down(o1))) << "params_out";
  }
}

TEST_F(CudaBackendTest, AdamWPropagatesNonFiniteGradients) {
  const int64_t n = 64;
  Backend::AdamWArgs a{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1.0f, 0.1f, 0.001f};
  auto g = randu(n, 80);
  g[5] = NAN;
  g[7] = INFINITY;
  FlatBuffer gp = upload(*gpu, randu(n, 81), DType::kF32), gg = upload(*gpu, g, DType::kF32),
             gm(*gpu, DType::kF32, n), gv(*gpu, DType::kF32, n), out(*gpu, DType::kBF16, n);
  gpu->adamw(gp.view(), gg.view(), gm.view(), gv.view(), out.view(), a);
  auto p = download(*gpu, gp), o = download(*gpu, out);
  for (int64_t i = 0; i < n; ++i) {
    const bool bad = i == 5 || i == 7;
    EXPECT_EQ(std::isfinite(p[static_cast<size_t>(i)]), !bad) << i;
    EXPECT_EQ(std::isfinite(o[static_cast<size_t>(i)]), !bad) << i;
  }
}

// ==== SGD ========================================================================================

TEST_P(CudaOpTest, SgdMatchesCpu) {
  const int64_t n = 10001;
  for (const auto& [momentum, nesterov] :
       std::vector<std::pair<float, bool>>{{0.9f, false}, {0.9f, true}, {0.0f, false}}) {
    for (int64_t off : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(testing::Message() << "momentum " << momentum << " nesterov " << nesterov
                                      << (off ? " unaligned slices" : " aligned"));
      Backend::SgdArgs a{};
      a.lr = 0.05f;
      a.momentum = momentum;
      a.weight_decay = 0.01f;
      a.grad_scale = 0.5f;
      a.nesterov = nesterov;
      const int64_t m = n - off;
      auto sl = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + off, v.end());
      };
      auto p = randu(static_cast<size_t>(n), 90, 1.0f);
      // A stale buffer: step 1 must overwrite it with g (first_step), on both backends.
      auto bb = std::vector<float>(static_cast<size_t>(n), 3.0f);
      FlatBuffer gp = upload(*gpu, p, DType::kF32), gb = upload(*gpu, bb, DType::kF32),
                 gout(*gpu, dt(), n);
      std::vector<float> cp = sl(p), cb = sl(bb);
      for (int t = 1; t <= 3; ++t) {
        a.first_step = t == 1;
        auto g = rounded(randu(static_cast<size_t>(n), 91 + static_cast<uint64_t>(t), 2.0f));
        FlatBuffer gg = up(g);
        auto gs = sl(g);
        const bool buf = momentum != 0.0f;
        cpu->sgd(host(cp, {m}), host(gs, {m}), buf ? host(cb, {m}) : Tensor(), Tensor(), a);
        gpu->sgd(gp.slice(off, m), gg.slice(off, m), buf ? gb.slice(off, m) : Tensor(),
                 gout.slice(off, m), a);
      }
      auto got_p = sl(download(*gpu, gp)), got_b = sl(download(*gpu, gb));
      expect_close(got_p, cp, 1e-5, 1e-6, "sgd master");
      expect_close(got_b, cb, 1e-5, 1e-6, "sgd momentum buffer");  // untouched when μ = 0
      auto got_out = sl(down(gout));
      for (size_t i = 0; i < got_out.size(); ++i) {
        const float want = fp32() ? got_p[i] : round_bf16(got_p[i]);
        ASSERT_EQ(got_out[i], want) << "params_out element " << i;
      }
    }
  }
}

// ==== matmul (cuda_matmul.cu) ====================================================================
// fp32 mode expects true fp32 GEMMs (no TF32): 1e-4 relative plus 1e-5·max absolute. bf16 mode:
// bf16 inputs, fp32 accumulation, outputs rounded to bf16: 2e-2 relative plus 2e-3·max absolute.

TEST_P(CudaOpTest, MatmulForward) {
  struct Case {
    int64_t N, IC, OC;
    bool bias;
    Epilogue epi;
  };
  for (const Case& cs :
       {Case{37, 64, 96, false, Epilogue::kNone}, Case{37, 64, 96, true, Epilogue::kNone},
        Case{64, 128, 512, true, Epilogue::kGelu},
        Case{32, 64, 97, false, Epilogue::kNone}}) {  // LM head: odd OC
    const int64_t N = cs.N, IC = cs.IC, OC = cs.OC;
    SCOPED_TRACE("N=" + std::to_string(N) + " IC=" + std::to_string(IC) +
                 " OC=" + std::to_string(OC) + (cs.bias ? " bias" : "") +
                 (cs.epi == Epilogue::kGelu ? " gelu" : ""));
    auto x = rounded(randu(static_cast<size_t>(N * IC), 90)),
         w = rounded(randu(static_cast<size_t>(OC * IC), 91, 0.2f)),
         b = rounded(randu(static_cast<size_t>(OC), 92));
    FlatBuffer gx = up(x), gw = up(w), gb = up(b), gy(*gpu, dt(), N * OC), gpre(*gpu, dt(), N * OC);
    std::vector<float> y(static_cast<size_t>(N * OC)), pre(y.size());
    const bool gelu = cs.epi == Epilogue::kGelu;
    cpu->matmul_forward(host(y, {N, OC}), host(x, {N, IC}), host(w, {OC, IC}),
                        cs.bias ? host(b, {OC}) : Tensor(), cs.epi,
                        gelu ? host(pre, {N, OC}) : Tensor());
    gpu->matmul_forward(dev(gy, {N, OC}), dev(gx, {N, IC}), dev(gw, {OC, IC}),
                        cs.bias ? dev(gb, {OC}) : Tensor(), cs.epi,
                        gelu ? dev(gpre, {N, OC}) : Tensor());
    expect_close(down(gy), y, rtol(1e-4), atol(1e-5), "matmul_forward out");
    if (gelu) expect_close(down(gpre), pre, rtol(1e-4), atol(1e-5), "matmul_forward pre_gelu");
  }
}

TEST_P(CudaOpTest, MatmulBackward) {
  struct Case {
    int64_t N, IC, OC;
    bool dinp, dbias, gelu_input;
  };
  for (const Case& cs :
       {Case{37, 64, 96, true, true, false}, Case{64, 512, 128, true, true, true},
        Case{37, 64, 96, false, true, false}, Case{32, 64, 97, true, false, false}}) {
    const int64_t N = cs.N, IC = cs.IC, OC = cs.OC;
    SCOPED_TRACE("N=" + std::to_string(N) + " IC=" + std::to_string(IC) +
                 " OC=" + std::to_string(OC) + (cs.dinp ? " dinp" : " no-dinp") +
                 (cs.dbias ? " dbias" : "") + (cs.gelu_input ? " dgelu" : ""));
    auto x = rounded(randu(static_cast<size_t>(N * IC), 100)),
         w = rounded(randu(static_cast<size_t>(OC * IC), 101, 0.2f)),
         dy = rounded(randu(static_cast<size_t>(N * OC), 102)),
         pre = rounded(randu(static_cast<size_t>(N * IC), 103, 3.0f)),
         dw0 = rounded(randu(static_cast<size_t>(OC * IC), 104)),
         db0 = rounded(randu(static_cast<size_t>(OC), 105));
    std::vector<float> dx(static_cast<size_t>(N * IC), 777.0f), dw = dw0, db = db0;
    cpu->matmul_backward(cs.dinp ? host(dx, {N, IC}) : Tensor(), host(dw, {OC, IC}),
                         cs.dbias ? host(db, {OC}) : Tensor(), host(dy, {N, OC}), host(x, {N, IC}),
                         host(w, {OC, IC}), cs.gelu_input ? host(pre, {N, IC}) : Tensor());
    // dinp starts as garbage (it is overwritten); dweight, dbias as values to accumulate onto.
    FlatBuffer gx = up(x), gw = up(w), gdy = up(dy), gpre = up(pre),
               gdx = up(std::vector<float>(static_cast<size_t>(N * IC), 777.0f)), gdw = up(dw0),
               gdb = up(db0);
    gpu->matmul_backward(cs.dinp ? dev(gdx, {N, IC}) : Tensor(), dev(gdw, {OC, IC}),
                         cs.dbias ? dev(gdb, {OC}) : Tensor(), dev(gdy, {N, OC}), dev(gx, {N, IC}),
                         dev(gw, {OC, IC}), cs.gelu_input ? dev(gpre, {N, IC}) : Tensor());
    if (cs.dinp) expect_close(down(gdx), dx, rtol(1e-4), atol(1e-5), "matmul_backward dinp");
    expect_close(down(gdw), dw, rtol(1e-4), atol(1e-5), "matmul_backward dweight");
    expect_close(down(gdb), db, rtol(1e-4), atol(1e-5),
                 cs.dbias ? "matmul_backward dbias" : "matmul_backward untouched dbias");
  }
}

// The LM head as the model runs it: logits with rows padded to padded_columns(V) (the GPU's
// GEMMs then read and write the logits in place), the fused cross-entropy over the first V
// columns, and the backward from the padded gradient rows — against the CPU on unpadded [N, V].
TEST_P(CudaOpTest, PaddedLogitRowsMatchCpu) {
  for (int64_t V : {int64_t{50257}, int64_t{97}}) {
    const int64_t N = 40, C = 64, Vp = gpu->padded_columns(V);
    SCOPED_TRACE("V=" + std::to_string(V) + " Vp=" + std::to_string(Vp));
    ASSERT_GE(Vp, V);
    ASSERT_EQ(Vp % 64, 0);
    auto x = rounded(randu(static_cast<size_t>(N * C), 70 + static_cast<uint64_t>(V)));
    auto w = rounded(randu(static_cast<size_t>(V * C), 71 + static_cast<uint64_t>(V), 0.5f));
    auto tg = randi(static_cast<size_t>(N), 72, static_cast<int32_t>(V));
    tg[3] = -1;
    const float gs = 0.25f;
    // CPU: logits [N, V], fused cross-entropy, dx = dlogits · W, dW += dlogitsᵀ · x.
    std::vector<float> logits(static_cast<size_t>(N * V)), loss(static_cast<size_t>(N)),
        dx(static_cast<size_t>(N * C)), dw(static_cast<size_t>(V * C), 0.0f);
    cpu->matmul_forward(host(logits, {N, V}), host(x, {N, C}), host(w, {V, C}), Tensor());
    cpu->softmax_cross_entropy(host(loss, {N}), host(logits, {N, V}), host_i32(tg, {N}), gs, V);
    cpu->matmul_backward(host(dx, {N, C}), host(dw, {V, C}), Tensor(), host(logits, {N, V}),
                         host(x, {N, C}), host(w, {V, C}));
    // GPU: the same on [N, Vp] rows (filled with garbage first: the forward must zero the pads).
    FlatBuffer gx = up(x), gw = up(w), gt = upload_i32(*gpu, tg), gloss(*gpu, DType::kF32, N),
               gdx(*gpu, dt(), N * C), gdw(*gpu, dt(), V * C),
               glogits = up(std::vector<float>(static_cast<size_t>(N * Vp), 3.0f));
    gpu->matmul_forward(dev(glogits, {N, Vp}), dev(gx, {N, C}), dev(gw, {V, C}), Tensor());
    const auto fwd = down(glogits);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = V; j < Vp; ++j)
        ASSERT_EQ(fwd[static_cast<size_t>(i * Vp + j)], 0.0f) << "pad column " << j << " row " << i;
    gpu->softmax_cross_entropy(dev(gloss, {N}), dev(glogits, {N, Vp}), dev(gt, {N}), gs, V);
    gpu->matmul_backward(dev(gdx, {N, C}), dev(gdw, {V, C}), Tensor(), dev(glogits, {N, Vp}),
                         dev(gx, {N, C}), dev(gw, {V, C}));
    expect_close(down(gloss), loss, rtol(1e-4), atol(1e-5), "padded-row losses");
    const auto dl = down(glogits);
    std::vector<float> dl_rows;  // the first V columns of each padded row
    for (int64_t i = 0; i < N; ++i)
      dl_rows.insert(dl_rows.end(), dl.begin() + i * Vp, dl.begin() + i * Vp + V);
    expect_close(dl_rows, logits, rtol(1e-4), fp32() ? 1e-7 : 1e-5, "padded-row dlogits");
    expect_close(down(gdx), dx, rtol(1e-3), atol(1e-4), "padded-row dinp");
    expect_close(down(gdw), dw, rtol(1e-3), atol(1e-4), "padded-row dweight");
  }
}

// ==== attention (cuda_attention.cu) ==============================================================
// fp32: 1e-4 relative plus 1e-5·max absolute. bf16: the probabilities are stored in bf16 and
// reused by backward, so errors compound: 2e-2 relative plus 2e-2·max absolute elementwise, and
// a cosine similarity above 0.999 per tensor.

TEST_P(CudaOpTest, AttentionForwardBackward) {
  struct Case {
    int64_t B, Tn, NH, hs;
  };
  for (const Case& cs : {Case{2, 33, 2, 64}, Case{2, 16, 2, 32}, Case{1, 128, 4, 64}}) {
    const int64_t B = cs.B, Tn = cs.Tn, NH = cs.NH, C = NH * cs.hs;
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(Tn) +
                 " NH=" + std::to_string(NH) + " hs=" + std::to_string(cs.hs));
    const auto nqkv = static_cast<size_t>(B * Tn * 3 * C), nout = static_cast<size_t>(B * Tn * C),
               nprob = static_cast<size_t>(B * NH * Tn * Tn);
    auto qkv = rounded(randu(nqkv, 110)), dy = rounded(randu(nout, 111));
    std::vector<float> out(nout), probs(nprob), dqkv(nqkv, 777.0f);
    AttentionSaved cs_saved{host(probs, {B, NH, Tn, Tn}), {}};
    cpu->attention_forward(host(out, {B, Tn, C}), cs_saved, host(qkv, {B, Tn, 3 * C}),
                           static_cast<int>(NH));
    cpu->attention_backward(host(dqkv, {B, Tn, 3 * C}), host(dy, {B, Tn, C}),
                            host(qkv, {B, Tn, 3 * C}), host(out, {B, Tn, C}), cs_saved,
                            static_cast<int>(NH));

    FlatBuffer gqkv = up(qkv), gdy = up(dy), gout(*gpu, dt(), static_cast<int64_t>(nout)),
               gdqkv = up(std::vector<float>(nqkv, 777.0f));
    ASSERT_TRUE(gpu->attention_saves_probs(static_cast<int>(cs.hs)));
    FlatBuffer gprobs(*gpu, gpu->attention_probs_dtype(), static_cast<int64_t>(nprob));
    AttentionSaved gs{dev(gprobs, {B, NH, Tn, Tn}), {}};
    gpu->attention_forward(dev(gout, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}),
                           static_cast<int>(NH));
    gpu->attention_backward(dev(gdqkv, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs,
                            static_cast<int>(NH));
    const double rt = rtol(1e-4), at = fp32() ? 1e-5 : 2e-2;
    auto got_out = down(gout), got_dqkv = down(gdqkv);
    expect_close(got_out, out, rt, at, "attention_forward out");
    expect_close(got_dqkv, dqkv, rt, at, "attention_backward dqkv");
    EXPECT_GT(cosine(got_out, out), 0.999);
    EXPECT_GT(cosine(got_dqkv, dqkv), 0.999);
    // Saved probabilities: only the causal part (t2 ≤ t) is specified.
    auto got_p = down(gprobs);
    std::vector<float> gp_causal, cp_causal;
    for (int64_t r = 0; r < B * NH; ++r)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const auto i = static_cast<size_t>((r * Tn + t) * Tn + t2);
          gp_causal.push_back(got_p[i]);
          cp_causal.push_back(probs[i]);
        }
    expect_close(gp_causal, cp_causal, rt, fp32() ? 1e-6 : 2e-3, "attention probs");
  }
}

// Attention dropout in the materialized kernels (this fixture's backends): saved probabilities
// stay the undropped softmax; out and dqkv match the CPU reference with the same mask.
TEST_P(CudaOpTest, AttentionWithDropoutMatchesCpu) {
  struct Case {
    int64_t B, Tn, NH, hs;
  };
  for (const Case& cs : {Case{2, 33, 2, 64}, Case{1, 300, 2, 32}}) {
    const int64_t B = cs.B, Tn = cs.Tn, NH = cs.NH, C = NH * cs.hs;
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(Tn));
    const Dropout d = test_dropout(0.2f, 4242, 5);
    const auto nqkv = static_cast<size_t>(B * Tn * 3 * C), nout = static_cast<size_t>(B * Tn * C),
               nprob = static_cast<size_t>(B * NH * Tn * Tn);
    auto qkv = rounded(randu(nqkv, 120)), dy = rounded(randu(nout, 121));
    std::vector<float> out(nout), probs(nprob), dqkv(nqkv);
    AttentionSaved cs_saved{host(probs, {B, NH, Tn, Tn}), {}};
    const int nh = static_cast<int>(NH);
    cpu->attention_forward(host(out, {B, Tn, C}), cs_saved, host(qkv, {B, Tn, 3 * C}), nh, d);
    cpu->attention_backward(host(dqkv, {B, Tn, 3 * C}), host(dy, {B, Tn, C}),
                            host(qkv, {B, Tn, 3 * C}), host(out, {B, Tn, C}), cs_saved, nh, d);
    FlatBuffer gqkv = up(qkv), gdy = up(dy), gout(*gpu, dt(), static_cast<int64_t>(nout)),
               gdqkv(*gpu, dt(), static_cast<int64_t>(nqkv)),
               gprobs(*gpu, gpu->attention_probs_dtype(), static_cast<int64_t>(nprob));
    AttentionSaved gs{dev(gprobs, {B, NH, Tn, Tn}), {}};
    gpu->attention_forward(dev(gout, {B, Tn, C}), gs, dev(gqkv, {B, Tn, 3 * C}), nh, d);
    gpu->attention_backward(dev(gdqkv, {B, Tn, 3 * C}), dev(gdy, {B, Tn, C}),
                            dev(gqkv, {B, Tn, 3 * C}), dev(gout, {B, Tn, C}), gs, nh, d);
    const double rt = rtol(1e-4), at = fp32() ? 1e-5 : 2e-2;
    auto got_out = down(gout), got_dqkv = down(gdqkv);
    expect_close(got_out, out, rt, at, "attention_forward out with dropout");
    expect_close(got_dqkv, dqkv, rt, at, "attention_backward dqkv with dropout");
    EXPECT_GT(cosine(got_out, out), 0.999);
    EXPECT_GT(cosine(got_dqkv, dqkv), 0.999);
    auto got_p = down(gprobs);
    std::vector<float> gp_causal, cp_causal;
    for (int64_t r = 0; r < B * NH; ++r)
      for (int64_t t = 0; t < Tn; ++t)
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const auto i = static_cast<size_t>((r * Tn + t) * Tn + t2);
          gp_causal.push_back(got_p[i]);
          cp_causal.push_back(probs[i]);
        }
    expect_close(gp_causal, cp_causal, rt, fp32() ? 1e-6 : 2e-3, "attention probs (undropped)");
  }
}

// ==== whole model ================================================================================
// GPT-2 with 2 layers, 2 heads, 64 channels, vocabulary 97, T = 16, B = 2, the same parameters
// on the CPU and the GPU. fp32: logits and loss within 1e-4 relative; every parameter gradient
// within 1e-3 relative elementwise (plus 1e-4·max|grad| absolute, for elements near zero through
// cancellation) and 1e-3 relative in L2 norm. bf16: loss within 2e-2 relative, logits and every
// parameter gradient with cosine similarity above 0.99.
