// CPU backend: the fp32 reference implementation of every op in backend/backend.h. The CpuBackend
// class holds host memory and dispatches each op to its op family's file (cpu_ops.h:
// cpu_encoder.cpp, cpu_layernorm.cpp, cpu_matmul.cpp, cpu_elementwise.cpp, cpu_attention.cpp,
// cpu_cross_entropy.cpp, cpu_reduce.cpp, cpu_quantize.cpp, cpu_optimizer.cpp; image ops:
// cpu_image_ops.h).
//
// Parallelism: OpenMP over rows / heads / channels with static schedules, and OpenBLAS sgemm for
// the matmuls. Every reduction is arranged so that each output element is summed by one thread
// in a fixed order, so results are bit-identical from run to run at the same thread count (the
// resume test relies on it).
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "backend/backend.h"
#include "backend/cpu/cpu_image_ops.h"
#include "backend/cpu/cpu_ops.h"
#include "core/error.h"

namespace shardtrain {
namespace {

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
      throw OutOfMemory(
          Memory::kHost,
          fmt::format("out of host memory: could not allocate {:.1f} MiB ({:.1f} MiB already "
                      "held by shardtrain)",
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

  // ---- embedding (cpu_encoder.cpp) -------------------------------------------------------------
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                         const Dropout& dropout) override {
    cpu::embedding_forward(out, tokens, wte, wpe, dropout);
  }

  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                          const Dropout& dropout) override {
    cpu::embedding_backward(dwte, dwpe, dout, tokens, dropout);
  }

  // ---- layernorm (cpu_layernorm.cpp) -----------------------------------------------------------
  void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                         Tensor bias) override {
    cpu::layernorm_forward(out, mean, rstd, inp, weight, bias);
  }

  void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                          Tensor weight, Tensor mean, Tensor rstd) override {
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd);
  }

  // ---- matmul (cpu_matmul.cpp) -----------------------------------------------------------------
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, Epilogue epilogue,
                      Tensor pre_gelu) override {
    cpu::matmul_forward(out, inp, weight, bias, epilogue, pre_gelu);
  }

  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, Tensor dinp_gelu_input) override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, dinp_gelu_input);
  }

  // ---- GELU, residual add, dropout (cpu_elementwise.cpp) ---------------------------------------
  void gelu_forward(Tensor out, Tensor inp) override { cpu::gelu_forward(out, inp); }

  void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) override {
    cpu::gelu_backward(dinp, inp, dout);
  }

  void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b) override {
    cpu::add(out, a, b, dropout_b);
  }

  void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) override {
    cpu::dropout_backward(dst, src, dropout);
  }

  // ---- attention (cpu_attention.cpp) -----------------------------------------------------------
  bool attention_saves_probs(int /*head_size*/) const override { return true; }

  void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                         const Dropout& dropout) override {
    cpu::attention_forward(out, saved, qkv, num_heads, dropout);
  }

  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, AttentionSaved saved,
                          int num_heads, const Dropout& dropout) override {
    cpu::attention_backward(dqkv, dout, qkv, out, saved, num_heads, dropout);
  }

  // ---- cross-entropy (cpu_cross_entropy.cpp) ---------------------------------------------------
  void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                             int64_t vocab) override {
    cpu::softmax_cross_entropy(losses, logits, targets, grad_scale, vocab);
  }

  void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets, int64_t vocab) override {
    cpu::cross_entropy_forward(losses, logits, targets, vocab);
  }

  // ---- sums, int8, scale, optimizer (cpu_reduce/quantize/elementwise/optimizer.cpp) ------------
  double sum_squares(Tensor x) override { return cpu::sum_squares(x); }
  double sum(Tensor x) override { return cpu::sum(x); }
  void quantize_int8(Tensor q, Tensor scales, Tensor x) override {
    cpu::quantize_int8(q, scales, x);
  }

  void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) override {
    cpu::dequantize_add_int8(out, q, scales);
  }

  void scale(Tensor x, float s) override { cpu::scale(x, s); }

  void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
             const AdamWArgs& a) override {
    cpu::adamw(master, grad, m, v, a);
    if (!params_out.empty() && params_out.data != master.data) convert(params_out, master);
  }

  void sgd(Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
           const SgdArgs& a) override {
    cpu::sgd(master, grad, momentum_buf, a);
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
  throw DeviceUnavailable(
      "CUDA: this shardtrain was built without CUDA (no nvcc at configure time); rebuild with "
      "the CUDA toolkit installed");  // the command line adds the CPU as the other remedy
}
bool cuda_available() { return false; }
std::vector<InfoLine> cuda_info() {
  return {{"CUDA", "not built in (configured without nvcc): CPU only"}};
}
#endif

}  // namespace shardtrain
