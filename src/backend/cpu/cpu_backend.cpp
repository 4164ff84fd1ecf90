// CPU backend: the fp32 reference implementation of every op in backend/backend.h.
//
// Parallelism: OpenMP over rows / heads / channels with static schedules, and OpenBLAS sgemm for
// the matmuls. Every reduction is arranged so that each output element is summed by one thread
// in a fixed order, so results are bit-identical from run to run at the same thread count (the
// resume test relies on it).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_image_ops.h"
#include "core/error.h"

namespace shardtrain {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

/// exp(x) to ~2 ulp for x in [-87, 88] (exp(-87) ≈ 1.6e-38 stands in for anything smaller):
/// Cody–Waite range reduction x = n·ln2 + r, then Cephes' degree-6 polynomial for e^r, then
/// scaling by 2^n through the exponent bits. Written so that GCC vectorizes loops over it
/// (libm's scalar expf dominated the vocabulary softmax: 51 M calls per GPT-2 step at T=128).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

/// Σ exp(row[j] - maxv) over j < n, writing the exponentials to `out` when non-null.
inline float exp_sum(const float* row, float* out, int64_t n, float maxv) {
  float sum = 0.f;
  if (out) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      out[j] = vexp(row[j] - maxv);
      sum += out[j];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += vexp(row[j] - maxv);
  }
  return sum;
}

inline float row_max(const float* row, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  return m;
}

/// Runs fn(c0, c1) on every OpenMP thread with its own slice [c0, c1) of [0, C): reductions over
/// rows into per-channel sums then never race, and each sum is taken in a fixed row order.
/// f[j] = the attention dropout multiplier (0 or 1/(1-p_effective)) of element base + j, j < n:
/// the 8-bit decisions of AttnDropout8 (core/philox.h), one Philox call per 16 elements.
void attention_dropout_factors(float* f, const Dropout& d, uint64_t base, int64_t n) {
  const uint32_t thresh = AttnDropout8::threshold(d);
  const float keep_scale = AttnDropout8::scale(d);
  uint32_t mask = 0;
  uint64_t group = ~uint64_t{0};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t idx = base + static_cast<uint64_t>(j);
    if ((idx >> 4) != group) {
      group = idx >> 4;
      mask = AttnDropout8::keep_mask16(d, idx & ~uint64_t{15}, thresh);
    }
    f[j] = (mask >> (idx & 15)) & 1u ? keep_scale : 0.0f;
  }
}

/// dst[j] = src[j] · multiplier of element base + j (dst may alias src).
void apply_dropout(float* dst, const float* src, const Dropout& d, uint64_t base, int64_t n) {
  const uint32_t thresh = d.threshold();
  const float keep_scale = d.scale();
  Philox4x32 r{};
  uint64_t group = ~uint64_t{0};
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t idx = base + static_cast<uint64_t>(j);
    if ((idx >> 2) != group) {
      group = idx >> 2;
      r = d.bits4(idx);
    }
    dst[j] = r.v[idx & 3] >= thresh ? src[j] * keep_scale : 0.0f;
  }
}

/// apply_dropout over elements [0, n), in parallel.
void apply_dropout_parallel(float* dst, const float* src, const Dropout& d, int64_t n) {
  constexpr int64_t kChunk = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    const int64_t lo = c * kChunk;
    apply_dropout(dst + lo, src + lo, d, static_cast<uint64_t>(lo), std::min(kChunk, n - lo));
  }
}

template <typename F>
void for_channel_slices(int64_t C, F&& fn) {
#pragma omp parallel
  {
    const int nth = omp_get_num_threads(), id = omp_get_thread_num();
    fn(C * id / nth, C * (id + 1) / nth);
  }
}

struct Allocation {
  size_t bytes;
};

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::kCPU; }
  std::string description() const override {
    return fmt::format("cpu ({} threads)", omp_get_max_threads());
  }
  DType compute_dtype() const override { return DType::kF32; }
  ImageOps* image_ops() override {
    if (!image_ops_) image_ops_ = make_cpu_image_ops();
    return image_ops_.get();
  }

  // ---- memory ----------------------------------------------------------------------------------
  void* allocate(size_t bytes) override {
    char* p = static_cast<char*>(allocate_uninitialized(bytes));
    std::memset(p, 0, static_cast<Allocation*>(static_cast<void*>(p - 64))->bytes);
    return p;
  }
  void* allocate_uninitialized(size_t bytes) override {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded + 64);
    if (!p) {
      throw RuntimeFailure(fmt::format(
          "out of host memory: could not allocate {:.1f} MiB ({:.1f} MiB already held by "
          "shardtrain); use a smaller model, --batch-size or --max-length",
          bytes / 1048576.0, allocated_ / 1048576.0));
    }
    // The first 64 bytes hold the size, so deallocate() can keep the accounting exact.
    static_cast<Allocation*>(p)->bytes = rounded;
    allocated_ += rounded;
    peak_ = std::max(peak_, allocated_);
    return static_cast<char*>(p) + 64;
  }
  void deallocate(void* ptr) noexcept override {
    if (!ptr) return;
    void* base = static_cast<char*>(ptr) - 64;
    allocated_ -= static_cast<Allocation*>(base)->bytes;
    std::free(base);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  void fill_zero(Tensor t) override { std::memset(t.data, 0, t.bytes()); }
  size_t allocated_bytes() const override { return allocated_; }
  size_t peak_allocated_bytes() const override { return peak_; }
  void reset_peak_memory() override { peak_ = allocated_; }

  void convert(Tensor dst, Tensor src) override {
    ST_ASSERT(dst.numel() == src.numel());
    if (dst.dtype == src.dtype) {
      copy(dst.data, src.data, src.bytes());
      return;
    }
    throw RuntimeFailure(fmt::format("cpu backend: conversion {} -> {} is not supported",
                                     dtype_name(src.dtype), dtype_name(dst.dtype)));
  }

  // ---- embedding -------------------------------------------------------------------------------
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                         const Dropout& dropout) override {
    const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
    const int32_t* tok = tokens.i32();
    const float* te = wte.f32();
    const float* pe = wpe.f32();
    float* o = out.f32();
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const float* e = te + static_cast<int64_t>(tok[b * T + t]) * C;
        const float* p = pe + t * C;
        float* y = o + (b * T + t) * C;
        for (int64_t c = 0; c < C; ++c) y[c] = e[c] + p[c];
        if (dropout.active())
          apply_dropout(y, y, dropout, static_cast<uint64_t>((b * T + t) * C), C);
      }
    }
  }

  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                          const Dropout& dropout) override {
    const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
    const int32_t* tok = tokens.i32();
    const float* d = dout.f32();
    std::vector<float> masked;
    if (dropout.active()) {  // the reference: mask dout first (the GPU fuses it into the scatter)
      masked.resize(static_cast<size_t>(dout.numel()));
      apply_dropout_parallel(masked.data(), d, dropout, dout.numel());
      d = masked.data();
    }
    float* dte = dwte.empty() ? nullptr : dwte.f32();  // either part may be skipped
    float* dpe = dwpe.empty() ? nullptr : dwpe.f32();
    // Each thread owns a slice of channels, so rows sharing a token never race and the order of
    // summation is fixed.
    for_channel_slices(C, [&](int64_t c0, int64_t c1) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const float* g = d + (b * T + t) * C;
          if (dte) {
            float* e = dte + static_cast<int64_t>(tok[b * T + t]) * C;
            for (int64_t c = c0; c < c1; ++c) e[c] += g[c];
          }
          if (dpe) {
            float* p = dpe + t * C;
            for (int64_t c = c0; c < c1; ++c) p[c] += g[c];
          }
        }
      }
    });
  }

  // ---- layernorm -------------------------------------------------------------------------------
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override {
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    const float* x = inp.f32();
    const float* w = weight.f32();
    const float* bb = bias.f32();
    float* y = out.f32();
    float* mu = mean.f32();
    float* rs = rstd.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * C;
      float m = 0.f;
      for (int64_t c = 0; c < C; ++c) m += xi[c];
      m /= static_cast<float>(C);
      float var = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        const float dx = xi[c] - m;
        var += dx * dx;
      }
      var /= static_cast<float>(C);
      const float s = 1.0f / std::sqrt(var + kLayerNormEps);
      float* yi = y + i * C;
      for (int64_t c = 0; c < C; ++c) yi[c] = (xi[c] - m) * s * w[c] + bb[c];
      mu[i] = m;
      rs[i] = s;
    }
  }

  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd) override {
    const int64_t C = inp.dim(-1), N = inp.numel() / C;
    const float* x = inp.f32();
    const float* w = weight.f32();
    const float* dy = dout.f32();
    const float* mu = mean.f32();
    const float* rs = rstd.f32();
    float* dx = dinp.f32();
    float* dw = dweight.f32();
    float* db = dbias.f32();
    // dinp: rows are independent.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xi = x + i * C;
      const float* dyi = dy + i * C;
      float dnorm_mean = 0.f, dnorm_norm_mean = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        const float norm = (xi[c] - mu[i]) * rs[i];
        const float dnorm = w[c] * dyi[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= static_cast<float>(C);
      dnorm_norm_mean /= static_cast<float>(C);
      float* dxi = dx + i * C;
      for (int64_t c = 0; c < C; ++c) {
        const float norm = (xi[c] - mu[i]) * rs[i];
        const float dnorm = w[c] * dyi[c];
        dxi[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs[i];
      }
    }
    // dweight, dbias: each thread owns a slice of channels and sums rows in order.
    for_channel_slices(C, [&](int64_t c0, int64_t c1) {
      for (int64_t i = 0; i < N; ++i) {
        const float* xi = x + i * C;
        const float* dyi = dy + i * C;
        for (int64_t c = c0; c < c1; ++c) {
          db[c] += dyi[c];
          dw[c] += (xi[c] - mu[i]) * rs[i] * dyi[c];
        }
      }
    });
  }

  // ---- matmul ----------------------------------------------------------------------------------
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                      Tensor pre_gelu) override {
    const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
    const int64_t ld = N > 0 ? out.numel() / N : OC;  // row stride: OC, or padded (no epilogue)
    ST_ASSERT(out.numel() == N * ld && ld >= OC && (ld == OC || epilogue == Epilogue::kNone));
    float* y = epilogue == Epilogue::kGelu ? pre_gelu.f32() : out.f32();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(N), static_cast<int>(OC),
                static_cast<int>(IC), 1.0f, inp.f32(), static_cast<int>(IC), weight.f32(),
                static_cast<int>(IC), 0.0f, y, static_cast<int>(ld));
    if (!bias.empty() || ld > OC) {
      const float* bb = bias.empty() ? nullptr : bias.f32();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < N; ++i) {
        float* yi = y + i * ld;
        if (bb)
          for (int64_t o = 0; o < OC; ++o) yi[o] += bb[o];
        std::fill(yi + OC, yi + ld, 0.0f);
      }
    }
    if (epilogue == Epilogue::kGelu) gelu_forward(out, pre_gelu);
  }

  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor dinp_gelu_input) override {
    const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
    const int64_t ld = N > 0 ? dout.numel() / N : OC;  // row stride of dout: OC or padded
    ST_ASSERT(dout.numel() == N * ld && ld >= OC);
    const float* dy = dout.f32();
    if (!dinp.empty()) {
      // dinp [N,IC] = dout [N,OC] · W [OC,IC]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(N),
                  static_cast<int>(IC), static_cast<int>(OC), 1.0f, dy, static_cast<int>(ld),
                  weight.f32(), static_cast<int>(IC), 0.0f, dinp.f32(), static_cast<int>(IC));
      if (!dinp_gelu_input.empty()) gelu_backward(dinp, dinp_gelu_input, dinp);
    }
    // dW [OC,IC] += doutᵀ [OC,N] · inp [N,IC]
    if (!dweight.empty())
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(OC),
                  static_cast<int>(IC), static_cast<int>(N), 1.0f, dy, static_cast<int>(ld),
                  inp.f32(), static_cast<int>(IC), 1.0f, dweight.f32(), static_cast<int>(IC));
    if (!dbias.empty()) {
      float* db = dbias.f32();
      for_channel_slices(OC, [&](int64_t o0, int64_t o1) {
        for (int64_t i = 0; i < N; ++i) {
          const float* dyi = dy + i * ld;
          for (int64_t o = o0; o < o1; ++o) db[o] += dyi[o];
        }
      });
    }
  }

  // ---- GELU ------------------------------------------------------------------------------------
  void gelu_forward(Tensor out, Tensor inp) override {
    const int64_t n = inp.numel();
    const float* x = inp.f32();
    float* y = out.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float cube = 0.044715f * v * v * v;
      y[i] = 0.5f * v * (1.0f + std::tanh(kGeluScale * (v + cube)));
    }
  }

  void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) override {
    const int64_t n = inp.numel();
    const float* x = inp.f32();
    const float* dy = dout.f32();
    float* dx = dinp.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float cube = 0.044715f * v * v * v;
      const float arg = kGeluScale * (v + cube);
      const float th = std::tanh(arg);
      const float sech2 = 1.0f - th * th;
      const float grad =
          0.5f * (1.0f + th) + 0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * v * v);
      dx[i] = grad * dy[i];
    }
  }

  void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) override {
    const int64_t n = out.numel();
    const float* x = a.f32();
    const float* y = b.f32();
    float* o = out.f32();
    if (dropout_b.active()) {
      const uint32_t thresh = dropout_b.threshold();
      const float keep_scale = dropout_b.scale();
#pragma omp parallel for schedule(static)
      for (int64_t g = 0; g < (n + 3) / 4; ++g) {
        const Philox4x32 r = dropout_b.bits4(static_cast<uint64_t>(g) * 4);
        for (int64_t i = g * 4; i < std::min(n, g * 4 + 4); ++i)
          o[i] = x[i] + (r.v[i & 3] >= thresh ? y[i] * keep_scale : 0.0f);
      }
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
  }

  void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) override {
    if (!dropout.active()) {
      if (dst.data != src.data) std::memmove(dst.data, src.data, src.bytes());
      return;
    }
    apply_dropout_parallel(dst.f32(), src.f32(), dropout, src.numel());
  }

  // ---- attention -------------------------------------------------------------------------------
  bool attention_saves_probs(int /*head_size*/) const override { return true; }

  void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                         const Dropout& dropout) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), C3 = qkv.dim(2), C = C3 / 3;
    const int64_t NH = num_heads, hs = C / NH;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    const float* x = qkv.f32();
    float* att = saved.probs.f32();
    float* y = out.f32();
    const bool drop = dropout.active();
#pragma omp parallel
    {
      std::vector<float> fac(drop ? static_cast<size_t>(T) : 0);
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < NH; ++h) {
          for (int64_t t = 0; t < T; ++t) {
            if (drop)
              attention_dropout_factors(fac.data(), dropout,
                                        static_cast<uint64_t>(((b * NH + h) * T + t) * T), t + 1);
            const float* q = x + (b * T + t) * C3 + h * hs;
            float* p = att + ((b * NH + h) * T + t) * T;
            float maxv = -INFINITY;
            for (int64_t t2 = 0; t2 <= t; ++t2) {
              const float* k = x + (b * T + t2) * C3 + C + h * hs;
              float s = 0.f;
              for (int64_t i = 0; i < hs; ++i) s += q[i] * k[i];
              s *= scale;
              p[t2] = s;
              maxv = std::max(maxv, s);
            }
            const float sum = exp_sum(p, p, t + 1, maxv);
            const float inv = 1.0f / sum;
            for (int64_t t2 = 0; t2 <= t; ++t2) p[t2] *= inv;
            for (int64_t t2 = t + 1; t2 < T; ++t2) p[t2] = 0.f;
            float* yt = y + (b * T + t) * C + h * hs;
            for (int64_t i = 0; i < hs; ++i) yt[i] = 0.f;
            for (int64_t t2 = 0; t2 <= t; ++t2) {
              const float* v = x + (b * T + t2) * C3 + 2 * C + h * hs;
              const float a = drop ? p[t2] * fac[static_cast<size_t>(t2)] : p[t2];
              for (int64_t i = 0; i < hs; ++i) yt[i] += a * v[i];
            }
          }
        }
      }
    }
  }

  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor /*out*/,
                          AttentionSaved saved, int num_heads, const Dropout& dropout) override {
    const int64_t B = qkv.dim(0), T = qkv.dim(1), C3 = qkv.dim(2), C = C3 / 3;
    const int64_t NH = num_heads, hs = C / NH;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    const float* x = qkv.f32();
    const float* att = saved.probs.f32();
    const float* dy = dout.f32();
    float* dx = dqkv.f32();
    // Each (b, h) touches only its own columns of dqkv, so (b, h) pairs run in parallel.
#pragma omp parallel
    {
      std::vector<float> datt(static_cast<size_t>(T));
      const bool drop = dropout.active();
      std::vector<float> fac(drop ? static_cast<size_t>(T) : 0);
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < NH; ++h) {
          for (int64_t t = 0; t < T; ++t) {
            float* dq = dx + (b * T + t) * C3 + h * hs;
            for (int64_t i = 0; i < hs; ++i) dq[i] = 0.f;
            float* dk = dx + (b * T + t) * C3 + C + h * hs;
            for (int64_t i = 0; i < hs; ++i) dk[i] = 0.f;
            float* dv = dx + (b * T + t) * C3 + 2 * C + h * hs;
            for (int64_t i = 0; i < hs; ++i) dv[i] = 0.f;
          }
          for (int64_t t = 0; t < T; ++t) {
            const float* p = att + ((b * NH + h) * T + t) * T;
            const float* dyt = dy + (b * T + t) * C + h * hs;
            // datt = dy · v ; dv += p * dy (with dropout: pd = p∘f, datt = (dy · v)∘f)
            if (drop)
              attention_dropout_factors(fac.data(), dropout,
                                        static_cast<uint64_t>(((b * NH + h) * T + t) * T), t + 1);
            float dot = 0.f;
            for (int64_t t2 = 0; t2 <= t; ++t2) {
              const float* v = x + (b * T + t2) * C3 + 2 * C + h * hs;
              float* dv = dx + (b * T + t2) * C3 + 2 * C + h * hs;
              const float f = drop ? fac[static_cast<size_t>(t2)] : 1.0f;
              const float pd = drop ? p[t2] * f : p[t2];
              float s = 0.f;
              for (int64_t i = 0; i < hs; ++i) {
                s += dyt[i] * v[i];
                dv[i] += pd * dyt[i];
              }
              if (drop) s *= f;
              datt[static_cast<size_t>(t2)] = s;
              dot += s * p[t2];
            }
            // softmax backward: dpre = p * (datt - Σ p·datt), then through q·kᵀ·scale.
            const float* q = x + (b * T + t) * C3 + h * hs;
            float* dq = dx + (b * T + t) * C3 + h * hs;
            for (int64_t t2 = 0; t2 <= t; ++t2) {
              const float dpre = p[t2] * (datt[static_cast<size_t>(t2)] - dot) * scale;
              const float* k = x + (b * T + t2) * C3 + C + h * hs;
              float* dk = dx + (b * T + t2) * C3 + C + h * hs;
              for (int64_t i = 0; i < hs; ++i) {
                dq[i] += dpre * k[i];
                dk[i] += dpre * q[i];
              }
            }
          }
        }
      }
    }
  }

  // ---- cross-entropy ---------------------------------------------------------------------------
  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                             int64_t vocab) override {
    const int64_t ld = logits.dim(-1), N = logits.numel() / ld, V = vocab;
    ST_ASSERT(V > 0 && V <= ld);
    float* lg = logits.f32();
    const int32_t* tg = targets.i32();
    float* ls = losses.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* row = lg + i * ld;
      const int32_t target = tg[i];
      if (target < 0) {
        ls[i] = 0.f;
        std::memset(row, 0, static_cast<size_t>(V) * sizeof(float));
        continue;
      }
      const float maxv = row_max(row, V);
      const float target_logit = row[target];
      const float sum = exp_sum(row, row, V, maxv);
      ls[i] = std::log(sum) + maxv - target_logit;
      const float inv = grad_scale / sum;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) row[j] *= inv;
      row[target] -= grad_scale;
    }
  }

  void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab) override {
    const int64_t ld = logits.dim(-1), N = logits.numel() / ld, V = vocab;
    ST_ASSERT(V > 0 && V <= ld);
    const float* lg = logits.f32();
    const int32_t* tg = targets.i32();
    float* ls = losses.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* row = lg + i * ld;
      if (tg[i] < 0) {
        ls[i] = 0.f;
        continue;
      }
      const float maxv = row_max(row, V);
      ls[i] = std::log(exp_sum(row, nullptr, V, maxv)) + maxv - row[tg[i]];
    }
  }

  // ---- reductions and optimizer ----------------------------------------------------------------
  template <typename F>
  static double ordered_sum(int64_t n, F term) {
    // Fixed chunking (independent of the thread count) summed in chunk order: deterministic.
    constexpr int64_t kChunk = 1 << 16;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> part(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      double s = 0.0;
      const int64_t end = std::min(n, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) s += term(i);
      part[static_cast<size_t>(c)] = s;
    }
    double total = 0.0;
    for (double p : part) total += p;
    return total;
  }

  double sum_squares(Tensor x) override {
    const float* p = x.f32();
    return ordered_sum(x.numel(), [p](int64_t i) {
      const double v = p[i];
      return v * v;
    });
  }
  double sum(Tensor x) override {
    const float* p = x.f32();
    return ordered_sum(x.numel(), [p](int64_t i) { return static_cast<double>(p[i]); });
  }
  void quantize_int8(Tensor q, Tensor scales, Tensor x) override {
    ST_ASSERT(x.dtype == DType::kF32 && q.dtype == DType::kU8 && scales.dtype == DType::kF32);
    const int64_t n = x.numel(), blocks = (n + kQuantBlock - 1) / kQuantBlock;
    ST_ASSERT(q.numel() == n && scales.numel() == blocks);
    const float* in = x.f32();
    auto* out = static_cast<int8_t*>(q.data);
    float* sc = scales.f32();
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
      float amax = 0;
      for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(in[i]));
      const float s = amax / 127.0f;
      sc[b] = s;
      for (int64_t i = lo; i < hi; ++i)
        out[i] = static_cast<int8_t>(s > 0 ? std::clamp(std::nearbyint(in[i] / s), -127.0f, 127.0f)
                                           : 0.0f);
    }
  }

  void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) override {
    ST_ASSERT(out.dtype == DType::kF32 && q.dtype == DType::kU8 && scales.dtype == DType::kF32);
    const int64_t n = out.numel();
    ST_ASSERT(q.numel() == n && scales.numel() == (n + kQuantBlock - 1) / kQuantBlock);
    float* o = out.f32();
    const auto* in = static_cast<const int8_t*>(q.data);
    const float* sc = scales.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] += static_cast<float>(in[i]) * sc[i / kQuantBlock];
  }

  void scale(Tensor x, float s) override {
    float* p = x.f32();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
  }

  void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
             const AdamWArgs& a) override {
    const int64_t n = master.numel();
    float* p = master.f32();
    const float* g = grad.f32();
    float* mm = m.f32();
    float* vv = v.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i] * a.grad_scale;
      const float mi = a.beta1 * mm[i] + (1.0f - a.beta1) * gi;
      const float vi = a.beta2 * vv[i] + (1.0f - a.beta2) * gi * gi;
      mm[i] = mi;
      vv[i] = vi;
      const float mhat = mi / a.bias_correction1;
      const float vhat = vi / a.bias_correction2;
      p[i] -= a.lr * (mhat / (std::sqrt(vhat) + a.eps) + a.weight_decay * p[i]);
    }
    if (!params_out.empty() && params_out.data != master.data) convert(params_out, master);
  }

  void sgd(Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
           const SgdArgs& a) override {
    const int64_t n = master.numel();
    ST_ASSERT(grad.numel() == n && grad.dtype == DType::kF32);
    const bool use_buf = a.momentum != 0.0f;
    ST_ASSERT(!use_buf || momentum_buf.numel() == n);
    ST_ASSERT(!a.nesterov || use_buf);
    float* p = master.f32();
    const float* g = grad.f32();
    float* buf = use_buf ? momentum_buf.f32() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i] * a.grad_scale + a.weight_decay * p[i];
      float d = gi;
      if (use_buf) {
        const float b = a.first_step ? gi : a.momentum * buf[i] + gi;
        buf[i] = b;
        d = a.nesterov ? gi + a.momentum * b : b;
      }
      p[i] -= a.lr * d;
    }
    if (!params_out.empty() && params_out.data != master.data) convert(params_out, master);
  }

 private:
  size_t allocated_ = 0;
  size_t peak_ = 0;
  std::unique_ptr<ImageOps> image_ops_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

#ifndef SHARDTRAIN_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int /*device_index*/, DType /*compute_dtype*/) {
  throw RuntimeFailure(
      "--device cuda: this shardtrain was built without CUDA (no nvcc at configure time); "
      "rebuild with the CUDA toolkit installed, or use --device cpu");
}
bool cuda_available() { return false; }
#endif

}  // namespace shardtrain
