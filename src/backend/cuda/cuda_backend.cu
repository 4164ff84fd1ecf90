// CUDA backend: the CudaBackend class, which checks each op's arguments and dispatches it to its
// op family's launcher (cuda_ops.h: cuda_encoder.cu, cuda_layernorm.cu, cuda_elementwise.cu,
// cuda_cross_entropy.cu, cuda_reduce.cu, cuda_optimizer.cu, cuda_quantize.cu, cuda_matmul.cu,
// cuda_attention.cu, cuda_flash_attention.cu; image ops: cuda_image.h), device memory through the
// caching allocator (cuda_allocator.h), and CUDA graphs.
//
// Precision: tensors are fp32, bf16 or fp16 (the "compute dtype" chosen at construction; the
// optimizer state and LayerNorm statistics are always fp32); every kernel loads its operands,
// computes and accumulates in fp32 (reductions that return to the host in fp64), and rounds once
// to nearest-even when it stores. The fp32 mode exists for testing: it matches the CPU reference
// (backend/cpu/) to within summation-order rounding.
//
// Ordering: every op is enqueued on one non-blocking compute stream; the host only waits in the
// blocking calls (copy_to_host, copy_from_host, sum, sum_squares, synchronize). Memory from the
// caching allocator is stream-ordered on that stream: a freed block may be handed out again at
// once because every later use of it is enqueued on the same stream after the earlier ones. Work
// on any other stream (e.g. a communicator's stream) must wait on the compute stream
// (cudaEventRecord / cudaStreamWaitEvent) before touching memory it did not allocate itself.
//
// Determinism: no kernel uses floating-point atomics. Reductions across rows (embedding, LayerNorm
// parameter gradients, sum, sum_squares) use a fixed decomposition and a fixed summation order, so
// results are bit-identical from run to run on the same GPU and launch configuration.
//
// llm.c (Karpathy, llmc/*.cuh) served as a model for the kernel structure (warp-per-row
// LayerNorm, block-per-row fused classifier, fused AdamW); the code here is written anew.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_allocator.h"
#include "backend/cuda/cuda_common.h"
#include "backend/cuda/cuda_host_transfer.h"
#include "backend/cuda/cuda_image.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_common.h"

namespace shardtrain::cuda {
namespace {

/// Sanity kernel: cudaFuncGetAttributes on it fails when this build has no code for the GPU.
__global__ void probe_kernel() {}

void require_float(const char* op, const char* name, const Tensor& t) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16)
    throw RuntimeFailure(
        strf("cuda %s: %s must be a floating tensor, got %s", op, name, dtype_name(t.dtype)));
}

void require_dtype(const char* op, const char* name, const Tensor& t, DType dt) {
  if (t.dtype != dt)
    throw RuntimeFailure(
        strf("cuda %s: %s must be %s, got %s", op, name, dtype_name(dt), dtype_name(t.dtype)));
}

/// The attention kernels, from SHARDTRAIN_ATTENTION: unset, empty or "flash" selects the fused
/// kernels (cuda_flash_attention.cu) for bf16/fp16 compute; "materialized" selects the
/// materialized-probabilities kernels (cuda_attention.cu), which fp32 always uses (the tight
/// fp32 parity tests run on them), as do head sizes the fused kernels lack. Read once, at
/// construction: attention_saves_probs() must not change under a model that sized its buffers by
/// it. Throws ConfigError for any other value.
bool use_flash_attention(DType compute_dtype) {
  const char* v = std::getenv("SHARDTRAIN_ATTENTION");
  const std::string mode = v ? v : "";
  if (mode == "materialized") return false;
  if (!mode.empty() && mode != "flash")
    throw ConfigError(
        strf("SHARDTRAIN_ATTENTION=%s: expected \"flash\" (the default) or "
             "\"materialized\"",
             v));
  // Head sizes the fused kernels lack fall back to the materialized ones (flash_for()).
  return compute_dtype == DType::kBF16 || compute_dtype == DType::kF16;
}

}  // namespace

/// StreamClock of timing CUDA events recorded on the compute stream, reused after each read.
class CudaStreamClock final : public StreamClock {
 public:
  CudaStreamClock(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaStreamClock() override {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  void mark() override {
    ST_CUDA_CHECK(cudaSetDevice(device_));
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      ST_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    ST_CUDA_CHECK(cudaEventRecord(events_[used_++], stream_));
  }
  std::vector<double> intervals() override {
    std::vector<double> out;
    if (used_ == 0) return out;
    ST_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (size_t i = 1; i < used_; ++i) {
      float ms = 0;
      ST_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
      out.push_back(1e-3 * ms);
    }
    used_ = 0;
    return out;
  }

 private:
  int device_;
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};

// ==== the backend ==============================================================================

class CudaBackend final : public Backend {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  CudaBackend(int device_index, DType compute_dtype) : dtype_(compute_dtype) {
    if (compute_dtype != DType::kF32 && compute_dtype != DType::kBF16 &&
        compute_dtype != DType::kF16)
      throw ConfigError(strf("cuda backend: compute dtype must be fp32, bf16 or fp16, got %s",
                             dtype_name(compute_dtype)));
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      // The command line adds the CPU as the other remedy (DeviceUnavailable).
      throw DeviceUnavailable(
          strf("CUDA: no CUDA GPU is visible (cudaGetDeviceCount: %s); check nvidia-smi and "
               "CUDA_VISIBLE_DEVICES",
               err != cudaSuccess
                   ? strf("%s: %s", cudaGetErrorName(err), cudaGetErrorString(err)).c_str()
                   : "0 devices"));
    }
    if (device_index < 0 || device_index >= count)
      throw RuntimeFailure(
          strf("cuda:%d: there is no such GPU: %d CUDA GPU%s visible (cuda:0%s); check "
               "CUDA_VISIBLE_DEVICES or pick another device",
               device_index, count, count == 1 ? " is" : "s are",
               count > 1 ? strf("..cuda:%d", count - 1).c_str() : ""));
    device_ = device_index;
    flash_ = use_flash_attention(compute_dtype);
    try {
      init();
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaBackend() override { release(); }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  std::string description() const override { return description_; }
  size_t device_memory_bytes() const override { return device_memory_; }
  DType compute_dtype() const override { return dtype_; }
  void* native_stream() const override { return ctx_.stream; }
  std::unique_ptr<StreamClock> make_stream_clock() override {
    return std::make_unique<CudaStreamClock>(device_, ctx_.stream);
  }

  // ---- memory (cuda_allocator.cu) ----------------------------------------------------------
  void* allocate(size_t bytes) override {
    activate();
    return alloc_->allocate(bytes);
  }
  void* allocate_uninitialized(size_t bytes) override {
    activate();
    return alloc_->allocate(bytes, /*zero_fill=*/false);
  }
  void deallocate(void* ptr) noexcept override {
    if (ptr == nullptr) return;
    // Returning a block to the cache makes no CUDA call: no device to make current.
    alloc_->deallocate(ptr);
  }
  void* allocate_pinned(size_t bytes) override {
    void* p = pinned_allocate(device_, bytes, pinned_bytes_);
    pinned_bytes_ += bytes;
    return p;
  }
  void free_pinned(void* ptr, size_t bytes) noexcept override {
    if (ptr == nullptr) return;
    pinned_free(device_, ptr);
    pinned_bytes_ -= bytes;
  }
  std::unique_ptr<DeviceTimeline> make_device_timeline() override {
    return cuda::make_device_timeline(device_, ctx_.stream);
  }
  std::unique_ptr<CopyStream> make_copy_stream() override {
    return cuda::make_copy_stream(device_, ctx_.stream);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    // Ordered after the work already on the stream (e.g. the zero-fill of a fresh allocation).
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy_from_host_async(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
  }
  std::unique_ptr<Graph> capture(const std::function<void()>& body) override;
  /// Device-to-device, enqueued on the compute stream (ordered with every op; not blocking).
  /// The ranges must not overlap.
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    activate();
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_.stream));
  }
  void fill_zero(Tensor t) override {
    if (t.empty() || t.bytes() == 0) return;
    activate();
    ST_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), ctx_.stream));
  }
  void synchronize() override {
    activate();
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  size_t allocated_bytes() const override { return alloc_->allocated(); }
  size_t peak_allocated_bytes() const override { return alloc_->peak_allocated(); }
  void reset_peak_memory() override { alloc_->reset_peak(); }

  /// Bytes obtained from cudaMalloc (in use + cached), and the peak since start or
  /// reset_peak_memory().
  size_t reserved_bytes() const { return alloc_->reserved(); }
  size_t peak_reserved_bytes() const { return alloc_->peak_reserved(); }
  /// Returns the allocator's cached blocks to CUDA (e.g. before handing memory to NCCL).
  void empty_cache() {
    activate();
    alloc_->release_cached();
  }
  const CudaContext& context() const { return ctx_; }

  // ---- dtype conversion (cuda_elementwise.cu) ----------------------------------------------
  void convert(Tensor dst, Tensor src) override {
    ST_ASSERT(dst.numel() == src.numel());
    activate();
    if (dst.dtype == src.dtype) {
      copy(dst.data, src.data, src.bytes());
      return;
    }
    require_float("convert", "dst", dst);
    require_float("convert", "src", src);
    const int64_t n = src.numel();
    if (n == 0) return;
    cuda::convert(ctx_, dst, src);
  }

  // ---- embedding (cuda_encoder.cu) ---------------------------------------------------------
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                         const Dropout& dropout) override {
    const char* op = "embedding_forward";
    const int64_t B = out.dim(0), Tn = out.dim(1), C = out.dim(2), N = B * Tn;
    require_dtype(op, "tokens", tokens, DType::kI32);
    require_float(op, "out", out);
    require_dtype(op, "wte", wte, out.dtype);
    require_dtype(op, "wpe", wpe, out.dtype);
    ST_ASSERT(tokens.numel() == N && wte.dim(1) == C && wpe.dim(1) == C && Tn <= wpe.dim(0));
    if (N == 0) return;
    activate();
    cuda::embedding_forward(ctx_, out, tokens, wte, wpe, dropout);
  }

  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                          const Dropout& dropout) override {
    const char* op = "embedding_backward";
    const int64_t B = dout.dim(0), Tn = dout.dim(1), C = dout.dim(2), N = B * Tn;
    require_dtype(op, "tokens", tokens, DType::kI32);
    require_float(op, "dout", dout);
    // Either part may be skipped (empty dwte or dwpe).
    if (!dwte.empty()) {
      require_dtype(op, "dwte", dwte, dout.dtype);
      ST_ASSERT(tokens.numel() == N && dwte.dim(1) == C);
    }
    if (!dwpe.empty()) {
      require_dtype(op, "dwpe", dwpe, dout.dtype);
      ST_ASSERT(dwpe.dim(1) == C && Tn <= dwpe.dim(0));
    }
    if (N >= (int64_t{1} << 31))
      throw RuntimeFailure(
          strf("cuda %s: %lld rows exceed the int32 sort", op, static_cast<long long>(N)));
    if (N == 0) return;
    activate();
    cuda::embedding_backward(ctx_, dwte, dwpe, dout, tokens, dropout);
  }

  // ---- layernorm (cuda_layernorm.cu) -------------------------------------------------------
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override {
    const char* op = "layernorm_forward";
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    require_float(op, "inp", inp);
    require_dtype(op, "out", out, inp.dtype);
    require_dtype(op, "weight", weight, inp.dtype);
    require_dtype(op, "bias", bias, inp.dtype);
    require_dtype(op, "mean", mean, DType::kF32);
    require_dtype(op, "rstd", rstd, DType::kF32);
    ST_ASSERT(out.numel() == N * C && weight.numel() == C && bias.numel() == C &&
              mean.numel() == N && rstd.numel() == N);
    if (N == 0) return;
    activate();
    cuda::layernorm_forward(ctx_, out, mean, rstd, inp, weight, bias);
  }

  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd) override {
    const char* op = "layernorm_backward";
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    require_float(op, "inp", inp);
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"dinp", dinp},
                                  {"dweight", dweight},
                                  {"dbias", dbias},
                                  {"dout", dout},
                                  {"weight", weight}})
      require_dtype(op, name, t, inp.dtype);
    require_dtype(op, "mean", mean, DType::kF32);
    require_dtype(op, "rstd", rstd, DType::kF32);
    ST_ASSERT(dinp.numel() == N * C && dout.numel() == N * C && weight.numel() == C &&
              dweight.numel() == C && dbias.numel() == C && mean.numel() == N && rstd.numel() == N);
    if (N == 0) return;
    activate();
    cuda::layernorm_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  }

  // ---- linear layers (cuda_matmul.cu) ------------------------------------------------------
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                      Tensor pre_gelu) override {
    activate();
    cuda::matmul_forward(ctx_, out, inp, weight, bias, epilogue, pre_gelu);
  }
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor dinp_gelu_input) override {
    activate();
    cuda::matmul_backward(ctx_, dinp, dweight, dbias, dout, inp, weight, dinp_gelu_input);
  }

  // ---- GELU, residual add, dropout (cuda_elementwise.cu) -----------------------------------
  void gelu_forward(Tensor out, Tensor inp) override {
    require_float("gelu_forward", "inp", inp);
    require_dtype("gelu_forward", "out", out, inp.dtype);
    ST_ASSERT(out.numel() == inp.numel());
    const int64_t n = inp.numel();
    if (n == 0) return;
    activate();
    cuda::gelu_forward(ctx_, out, inp);
  }

  void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) override {
    require_float("gelu_backward", "inp", inp);
    require_dtype("gelu_backward", "dinp", dinp, inp.dtype);
    require_dtype("gelu_backward", "dout", dout, inp.dtype);
    ST_ASSERT(dinp.numel() == inp.numel() && dout.numel() == inp.numel());
    const int64_t n = inp.numel();
    if (n == 0) return;
    activate();
    cuda::gelu_backward(ctx_, dinp, inp, dout);
  }

  void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) override {
    require_float("add", "out", out);
    require_dtype("add", "a", a, out.dtype);
    require_dtype("add", "b", b, out.dtype);
    ST_ASSERT(a.numel() == out.numel() && b.numel() == out.numel());
    const int64_t n = out.numel();
    if (n == 0) return;
    activate();
    cuda::add(ctx_, out, a, b, dropout_b);
  }

  void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) override {
    require_float("dropout_backward", "src", src);
    require_dtype("dropout_backward", "dst", dst, src.dtype);
    ST_ASSERT(dst.numel() == src.numel());
    const int64_t n = src.numel();
    if (n == 0) return;
    activate();
    cuda::dropout_backward(ctx_, dst, src, dropout);
  }

  // ---- attention (cuda_attention.cu; cuda_flash_attention.cu when flash_) ------------------
  void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                         const Dropout& dropout) override {
    activate();
    if (flash_for(qkv.dim(2) / 3 / num_heads))
      cuda::flash_attention_forward(ctx_, out, saved.lse, qkv, num_heads, dropout);
    else
      cuda::attention_forward(ctx_, out, saved, qkv, num_heads, dropout);
  }
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, AttentionSaved saved,
                          int num_heads, const Dropout& dropout) override {
    activate();
    if (flash_for(qkv.dim(2) / 3 / num_heads))
      cuda::flash_attention_backward(ctx_, dqkv, dout, qkv, out, saved.lse, num_heads, dropout);
    else
      cuda::attention_backward(ctx_, dqkv, dout, qkv, out, saved, num_heads, dropout);
  }
  bool attention_saves_probs(int head_size) const override { return !flash_for(head_size); }
  DType attention_probs_dtype() const override { return dtype_; }

  // ---- cross-entropy (cuda_cross_entropy.cu) -----------------------------------------------
  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                             int64_t vocab) override {
    cross_entropy(losses, logits, targets, vocab, grad_scale, true);
  }
  void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab) override {
    cross_entropy(losses, logits, targets, vocab, 0.0f, false);
  }
  /// A multiple of 64: cuBLASLt's fast kernels need the GEMM dimension a multiple of 8
  /// (cuda_matmul.cu, "padding an awkward OC"); 64 also keeps every row 128-byte aligned.
  int64_t padded_columns(int64_t oc) const override { return (oc + 63) / 64 * 64; }

  // ---- sums, int8, scale, optimizer (cuda_reduce/quantize/elementwise/optimizer.cu) --------
  double sum_squares(Tensor x) override { return reduce(x, true); }
  double sum(Tensor x) override { return reduce(x, false); }

  void quantize_int8(Tensor q, Tensor scales, Tensor x) override {
    require_float("quantize_int8", "x", x);
    require_dtype("quantize_int8", "q", q, DType::kU8);
    require_dtype("quantize_int8", "scales", scales, DType::kF32);
    activate();
    cuda::quantize_int8(ctx_, q, scales, x);
  }

  void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) override {
    require_float("dequantize_add_int8", "out", out);
    require_dtype("dequantize_add_int8", "q", q, DType::kU8);
    require_dtype("dequantize_add_int8", "scales", scales, DType::kF32);
    activate();
    cuda::dequantize_add_int8(ctx_, out, q, scales);
  }

  void scale(Tensor x, float s) override {
    require_float("scale", "x", x);
    const int64_t n = x.numel();
    if (n == 0 || x.empty()) return;
    activate();
    cuda::scale(ctx_, x, s);
  }

  /// The dtypes and sizes adamw() needs (master, m, v fp32; grad and params_out floating,
  /// params_out empty or aliasing master: not written); returns n.
  static int64_t check_adamw(const Tensor& master, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const Tensor& params_out) {
    const char* op = "adamw";
    require_dtype(op, "master", master, DType::kF32);
    require_dtype(op, "m", m, DType::kF32);
    require_dtype(op, "v", v, DType::kF32);
    require_float(op, "grad", grad);
    const int64_t n = master.numel();
    ST_ASSERT(grad.numel() == n && m.numel() == n && v.numel() == n);
    if (!params_out.empty() && params_out.data != master.data) {
      require_float(op, "params_out", params_out);
      ST_ASSERT(params_out.numel() == n);
    }
    return n;
  }

  void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
             const AdamWArgs& args) override {
    if (check_adamw(master, grad, m, v, params_out) == 0) return;
    activate();
    cuda::adamw(ctx_, master, grad, m, v, params_out, args);
  }

  void adamw_runs(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
                  const std::vector<AdamWRun>& runs, AdamWArgs args) override {
    const int64_t n = check_adamw(master, grad, m, v, params_out);
    int64_t covered = 0;
    for (const AdamWRun& r : runs) {
      ST_ASSERT(r.begin == covered && r.count >= 0);
      covered += r.count;
    }
    ST_ASSERT(covered == n);
    if (n == 0) return;
    activate();
    cuda::adamw_runs(ctx_, master, grad, m, v, params_out, runs, args);
  }

  /// Convolution, batch norm, pooling and LSTM (cuda_image.h); cuDNN is loaded on first use, so
  /// GPT-2 runs never pay for it.
  ImageOps* image_ops() override {
    if (!image_ops_) {
      activate();
      image_ops_ = make_cuda_image_ops(ctx_, *this);
    }
    return image_ops_.get();
  }

  void sgd(Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
           const SgdArgs& args) override {
    const char* op = "sgd";
    require_dtype(op, "master", master, DType::kF32);
    require_float(op, "grad", grad);
    const int64_t n = master.numel();
    const bool use_buf = args.momentum != 0.0f;
    ST_ASSERT(grad.numel() == n && (!args.nesterov || use_buf));
    if (use_buf) {
      require_dtype(op, "momentum_buf", momentum_buf, DType::kF32);
      ST_ASSERT(momentum_buf.numel() == n);
    }
    // params_out aliasing the master (fp32 parameters) is the master itself: nothing to write.
    const bool has_out = !params_out.empty() && params_out.data != master.data;
    if (has_out) {
      require_float(op, "params_out", params_out);
      ST_ASSERT(params_out.numel() == n);
    }
    if (n == 0) return;
    activate();
    cuda::sgd(ctx_, master, grad, momentum_buf, params_out, args);
  }

 private:
  void init() {
    ST_CUDA_CHECK(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_memory_ = prop.totalGlobalMem;
    description_ = strf("%s (cuda:%d, %.1f GiB)", prop.name, device_,
                        static_cast<double>(prop.totalGlobalMem) / 1073741824.0);
    cudaFuncAttributes attr{};
    const cudaError_t probe = cudaFuncGetAttributes(&attr, probe_kernel);
    if (probe != cudaSuccess) {
      (void)cudaGetLastError();
      throw RuntimeFailure(
          strf("cuda:%d: %s (compute capability %d.%d) cannot run this build's kernels (%s); "
               "reconfigure with -DCMAKE_CUDA_ARCHITECTURES=%d%d and rebuild",
               device_, prop.name, prop.major, prop.minor, cudaGetErrorString(probe), prop.major,
               prop.minor));
    }
    ctx_.device = device_;
    ctx_.sm_count = prop.multiProcessorCount;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    ST_CUBLAS_CHECK(cublasLtCreate(&ctx_.lt));
    ST_CUBLAS_CHECK(cublasCreate(&ctx_.blas));
    ST_CUBLAS_CHECK(cublasSetStream(ctx_.blas, ctx_.stream));
    alloc_ = std::make_unique<CachingAllocator>(device_, ctx_.stream);
    ctx_.workspace = alloc_->allocate(kWorkspaceBytes);
    ctx_.workspace_bytes = kWorkspaceBytes;
    // cuBLAS shares the workspace: both handles only ever run on the compute stream, in order.
    ST_CUBLAS_CHECK(cublasSetWorkspace(ctx_.blas, ctx_.workspace, kWorkspaceBytes));
    ctx_.scratch = &CudaBackend::scratch_callback;
    ctx_.backend = this;
    ST_CUDA_CHECK(cudaMallocHost(&host_result_, sizeof(double)));
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }

  void release() noexcept {
    (void)cudaSetDevice(device_);
    if (ctx_.stream) (void)cudaStreamSynchronize(ctx_.stream);
    image_ops_.reset();  // its cuDNN handle uses the stream
    alloc_.reset();      // frees every block, the workspace and the scratch included
    ctx_.workspace = nullptr;
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    if (host_result_) (void)cudaFreeHost(host_result_);
    host_result_ = nullptr;
    if (ctx_.blas) (void)cublasDestroy(ctx_.blas);
    if (ctx_.lt) (void)cublasLtDestroy(ctx_.lt);
    if (ctx_.stream) (void)cudaStreamDestroy(ctx_.stream);
    ctx_.blas = nullptr;
    ctx_.lt = nullptr;
    ctx_.stream = nullptr;
    (void)cudaGetLastError();
  }

  /// Makes this backend's GPU current for the calling thread. Only a cudaGetDevice (a
  /// thread-local read) when it already is: cudaSetDevice itself is not free, and the caching
  /// allocator's callers reach this once per activation taken and returned (as PyTorch's
  /// c10::cuda::MaybeSetDevice).
  void activate() const {
    int current = -1;
    ST_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) ST_CUDA_CHECK(cudaSetDevice(device_));
  }

  static void* scratch_callback(void* self, size_t bytes) {
    return static_cast<CudaBackend*>(self)->grow_scratch(bytes);
  }

  /// Scratch of at least `bytes`, valid until the next call. Growing waits for the stream first:
  /// kernels already enqueued may still read or write the old buffer.
  void* grow_scratch(size_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    ST_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    alloc_->deallocate(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    const size_t want = std::max<size_t>(bytes, size_t{1} << 20);
    scratch_ = alloc_->allocate(want);
    scratch_bytes_ = want;
    return scratch_;
  }

  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, int64_t V, float grad_scale,
                     bool write_grad) {
    const char* op = write_grad ? "softmax_cross_entropy" : "cross_entropy_forward";
    const int64_t ld = logits.dim(-1), N = logits.numel() / ld;
    if (V <= 0 || V > ld)
      throw RuntimeFailure(strf("cuda %s: vocabulary %lld does not fit rows of %lld columns", op,
                                static_cast<long long>(V), static_cast<long long>(ld)));
    require_float(op, "logits", logits);
    require_dtype(op, "losses", losses, DType::kF32);
    require_dtype(op, "targets", targets, DType::kI32);
    ST_ASSERT(losses.numel() == N && targets.numel() == N);
    if (N >= (int64_t{1} << 31))
      throw RuntimeFailure(strf("cuda %s: too many rows (%lld)", op, static_cast<long long>(N)));
    if (N == 0) return;
    activate();
    cuda::cross_entropy(ctx_, losses, logits, targets, V, grad_scale, write_grad);
  }

  /// Σ x (or Σ x²) in fp64: a fixed grid of partial sums, then one block; blocking.
  double reduce(Tensor x, bool square) {
    require_float(square ? "sum_squares" : "sum", "x", x);
    const int64_t n = x.numel();
    if (n == 0 || x.empty()) return 0.0;
    activate();
    return cuda::reduce_sum(ctx_, x, square, host_result_);
  }

  int device_ = 0;
  DType dtype_;
  /// Whether attention over heads of `head_size` channels runs the fused kernels: the backend
  /// chose them (flash_) and they support that head size (32, 64, 128); else materialized.
  bool flash_for(int64_t head_size) const {
    return flash_ && cuda::flash_attention_supported(dtype_, static_cast<int>(head_size));
  }
  bool flash_ = false;  ///< fused attention (bf16/fp16 unless SHARDTRAIN_ATTENTION=materialized)
  std::string description_;
  size_t device_memory_ = 0;  ///< cudaDeviceProp::totalGlobalMem
  CudaContext ctx_;
  std::unique_ptr<CachingAllocator> alloc_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  double* host_result_ = nullptr;        ///< pinned: the result of sum / sum_squares
  std::unique_ptr<ImageOps> image_ops_;  ///< made on first use
};

std::unique_ptr<Backend::Graph> CudaBackend::capture(const std::function<void()>& body) {
  activate();
  return capture_graph(*alloc_, ctx_.stream, device_, body);
}

}  // namespace shardtrain::cuda

namespace shardtrain {

std::unique_ptr<Backend> make_cuda_backend(int device_index, DType compute_dtype) {
  return std::make_unique<cuda::CudaBackend>(device_index, compute_dtype);
}

bool cuda_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

}  // namespace shardtrain
