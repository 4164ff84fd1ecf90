// What the CUDA image ops' files share: the activations as device functions, the argument checks,
// and the launchers each file provides to the CudaImageOps class (cuda_image_ops.cu):
//   cuda_conv.cu      — convolution through cuDNN (legacy convolution API, measured algorithms)
//   cuda_batchnorm.cu — batch normalization, split at its reductions (fp64 per-channel sums)
//   cuda_lstm.cu      — one LSTM layer over cuBLASLt GEMMs and fused gate kernels
// Semantics are exactly those of the same-named ImageOps methods (backend/image_ops.h); every
// launcher enqueues on ctx.stream and never synchronizes (except cuDNN's one-time algorithm
// search for a new convolution shape). Activations and parameters share one floating dtype (the
// backend's compute dtype: fp32, bf16 or fp16); arithmetic and accumulation are fp32 (fp64 for
// batch norm's sums).
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"
#include "backend/cuda/cuda_common.h"
#include "backend/image_ops.h"

namespace shardtrain::cuda {

// ---- activations (the CPU reference's definitions: backend/cpu/cpu_image_detail.h) -----------

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <Activation A>
__device__ __forceinline__ float act_forward(float x) {
  if constexpr (A == Activation::kRelu) return fmaxf(x, 0.0f);
  if constexpr (A == Activation::kRelu6) return fminf(fmaxf(x, 0.0f), 6.0f);
  if constexpr (A == Activation::kSilu) return x * sigmoidf(x);
  if constexpr (A == Activation::kSigmoid) return sigmoidf(x);
  return x;
}

/// act'(x) at the pre-activation x; ReLU's and ReLU6's kinks take 0, as PyTorch.
template <Activation A>
__device__ __forceinline__ float act_derivative(float x) {
  if constexpr (A == Activation::kRelu) return x > 0.0f ? 1.0f : 0.0f;
  if constexpr (A == Activation::kRelu6) return x > 0.0f && x < 6.0f ? 1.0f : 0.0f;
  if constexpr (A == Activation::kSilu) {
    const float s = sigmoidf(x);
    return s * (1.0f + x * (1.0f - s));
  }
  if constexpr (A == Activation::kSigmoid) {
    const float s = sigmoidf(x);
    return s * (1.0f - s);
  }
  return 1.0f;
}

/// Calls f.template operator()<A>() with A = a (kernels take the activation as a template
/// argument, so each is compiled without a branch per element).
template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kNone:
      f.template operator()<Activation::kNone>();
      return;
    case Activation::kRelu:
      f.template operator()<Activation::kRelu>();
      return;
    case Activation::kRelu6:
      f.template operator()<Activation::kRelu6>();
      return;
    case Activation::kSilu:
      f.template operator()<Activation::kSilu>();
      return;
    case Activation::kSigmoid:
      f.template operator()<Activation::kSigmoid>();
      return;
  }
}

/// Σ of `v` over the block (blockDim.x a multiple of 32, ≤ 1024), returned to every thread.
/// `shared` holds 32 values. Fixed order: deterministic.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Device memory from the backend's caching allocator for the duration of one op (stream-ordered:
/// freeing it right after enqueueing the kernels that use it is safe). Uninitialized: the op
/// writes it before reading it (a cuDNN output accumulated with β = 1 is first copied in).
class Temp {
 public:
  Temp(Backend& be, DType dt, std::initializer_list<int64_t> dims)
      : be_(be), t_(nullptr, dt, DeviceKind::kCUDA, dims) {
    t_.data = be_.allocate_uninitialized(t_.bytes());
  }
  ~Temp() { be_.deallocate(t_.data); }
  Temp(const Temp&) = delete;
  Temp& operator=(const Temp&) = delete;
  const Tensor& operator*() const { return t_; }

 private:
  Backend& be_;
  Tensor t_;
};

// ---- image layout
// ---------------------------------------------------------------------------------

/// i / d and i % d in 32-bit arithmetic when i fits (several times cheaper than 64-bit division,
/// which dominated the element-wise image kernels), else 64-bit.
__device__ __forceinline__ int64_t idiv(int64_t i, int64_t d) {
  return i <= 0x7fffffff && d <= 0x7fffffff
             ? static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(d))
             : i / d;
}
__device__ __forceinline__ int64_t imod(int64_t i, int64_t d) {
  return i <= 0x7fffffff && d <= 0x7fffffff
             ? static_cast<int64_t>(static_cast<uint32_t>(i) % static_cast<uint32_t>(d))
             : i % d;
}

/// Where element (n, c, h, w) of an [N, C, H, W] image lives: NCHW, or channels-last (NHWC) when
/// `nhwc` (ImageOps::channels_last()). Kernels branch on `nhwc` uniformly across the grid.
struct ImageIndex {
  int64_t C, H, W;
  bool nhwc;
  __host__ __device__ int64_t at(int64_t n, int64_t c, int64_t h, int64_t w) const {
    return nhwc ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
  }
  /// The coordinates of flat index i.
  __device__ void coords(int64_t i, int64_t& n, int64_t& c, int64_t& h, int64_t& w) const {
    if (nhwc) {
      const int64_t p = idiv(i, C), t = idiv(p, W);
      c = i - p * C;
      w = p - t * W;
      n = idiv(t, H);
      h = t - n * H;
    } else {
      const int64_t p = idiv(i, W), t = idiv(p, H);
      w = i - p * W;
      h = p - t * H;
      n = idiv(t, C);
      c = t - n * C;
    }
  }
  __device__ int64_t channel(int64_t i) const {
    return nhwc ? imod(i, C) : imod(idiv(i, H * W), C);
  }
  __device__ int64_t image(int64_t i) const { return idiv(i, C * H * W); }
};

/// Eight consecutive elements as fp32: one 16-byte access for bf16/fp16 (the channels-last kernels
/// take 8 channels of a pixel per thread; scalar 2-byte accesses left them at ~40% of the memory
/// bandwidth). `p` must be 16-byte aligned for 2-byte types (see vec8_ok).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(p[k]);
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_float<T>(v[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) p[k] = from_float<T>(v[k]);
  }
}
/// Whether a channels-last op may take 8 channels per thread: C a multiple of 8 and every image
/// pointer 16-byte aligned.
inline bool vec8_ok(bool nhwc, int64_t C, std::initializer_list<const void*> ptrs) {
  if (!nhwc || C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

/// Column partials of a channels-last image seen as rows [N·H·W, C]: blocks of kColTile channels ×
/// kColRows rows, grid (⌈C / kColTile⌉, groups); each block's rows are a contiguous range, and
/// its 32 channels make each row's load one coalesced segment.
constexpr unsigned kColTile = 32, kColRows = 8;
/// Row groups for a column reduction over `rows` rows of C channels (≈ 4 blocks per SM, ≥ 64
/// rows per block).
int64_t column_groups(const CudaContext& ctx, int64_t rows, int64_t C);

// ---- argument checks (RuntimeFailure naming the op, the tensor and what was expected) ---------

/// `t` is a CUDA tensor of dtype `dt` with exactly `dims`.
void expect_tensor(const char* op, const char* name, const Tensor& t, DType dt,
                   std::initializer_list<int64_t> dims);
/// expect_tensor unless `t` is empty (optional operands).
void expect_tensor_or_empty(const char* op, const char* name, const Tensor& t, DType dt,
                            std::initializer_list<int64_t> dims);
/// `t` is a 4-D CUDA tensor of dtype `dt` (NCHW); the shape is read from it.
void expect_nchw(const char* op, const char* name, const Tensor& t, DType dt);

/// Blocks of kImageBlock threads covering n items with grid-stride loops (≤ 32 per SM).
constexpr unsigned kImageBlock = 256;
unsigned grid_for(const CudaContext& ctx, int64_t n);
/// How many groups of images the per-channel reductions (batch norm's sums, the depthwise weight
/// gradient) split N images of HW values into: enough blocks of (channel, group) to fill the GPU
/// (4 per SM), at most one group per image, at least ~1024 values per block.
int64_t image_groups(const CudaContext& ctx, int64_t N, int64_t C, int64_t HW);

// ---- cuda_conv.cu ---------------------------------------------------------------------------

/// cuDNN handle, descriptors and the per-shape algorithm choice (see cuda_conv.cu).
class ConvRunner {
 public:
  virtual ~ConvRunner() = default;
  /// `nhwc`: the images (inp, out, dinp, dout) are channels-last.
  virtual void forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const Conv2dShape& s,
                       Activation act, bool nhwc) = 0;
  virtual void backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                        Tensor weight, const Conv2dShape& s, bool nhwc) = 0;
};
/// `backend` provides the temporaries of the channels-last path.
std::unique_ptr<ConvRunner> make_conv_runner(const CudaContext& ctx, Backend& backend);

/// dst [B, Y, X] = src [B, X, Y] for each of B matrices (a tiled transpose): NCHW ↔ NHWC with
/// X = C, Y = H·W (or back with X, Y swapped), and KCRS ↔ KRSC weights.
void batched_transpose(const CudaContext& ctx, Tensor dst, Tensor src, int64_t B, int64_t X,
                       int64_t Y);

/// out = act(out + bias[k]) (bias may be empty) in place, out an [N, K, P·Q] image (channels-last
/// when `nhwc`).
void bias_activation(const CudaContext& ctx, Tensor out, Tensor bias, int64_t K, int64_t PQ,
                     Activation act, bool nhwc);
/// dbias [K] += Σ_{n,pq} dout, dout an [N, K, P·Q] image (channels-last when `nhwc`).
void bias_gradient(const CudaContext& ctx, Tensor dbias, Tensor dout, int64_t N, int64_t K,
                   int64_t PQ, bool nhwc);

// ---- cuda_depthwise.cu --------------------------------------------------------------------------

/// Whether `s` is a depthwise convolution (groups = C = K, window ≤ 7×7) that the direct kernels
/// below take instead of cuDNN.
bool is_depthwise(const Conv2dShape& s);
/// out [N,C,P,Q] = depthwise conv(inp [N,C,H,W], weight [C,1,R,S]) (no bias, no activation);
/// images channels-last when `nhwc`.
void depthwise_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                       const Conv2dShape& s, bool nhwc);
/// dweight += ∂L/∂weight; dinp (overwritten; may be empty) from dout.
void depthwise_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                        Tensor inp, Tensor weight, const Conv2dShape& s, bool nhwc);

// ---- cuda_batchnorm.cu (images channels-last when `nhwc`) --------------------------------------

void batchnorm_statistics(const CudaContext& ctx, Tensor sums, Tensor inp, bool nhwc);
void batchnorm_forward_train(const CudaContext& ctx, Tensor out, Tensor mean, Tensor invstd,
                             Tensor running_mean, Tensor running_var, Tensor inp, Tensor weight,
                             Tensor bias, Tensor sums, int64_t count, float eps, float momentum,
                             Activation act, bool nhwc);
void batchnorm_forward_eval(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                            Tensor bias, Tensor running_mean, Tensor running_var, float eps,
                            Activation act, bool nhwc);
void batchnorm_backward_reduce(const CudaContext& ctx, Tensor dsums, Tensor dweight, Tensor dbias,
                               Tensor dout, Tensor inp, Tensor weight, Tensor bias, Tensor mean,
                               Tensor invstd, Activation act, bool nhwc);
void batchnorm_backward_input(const CudaContext& ctx, Tensor dinp, Tensor dout, Tensor inp,
                              Tensor weight, Tensor bias, Tensor mean, Tensor invstd, Tensor dsums,
                              int64_t count, Activation act, bool nhwc);

// ---- cuda_lstm.cu -------------------------------------------------------------------------------

/// One LSTM layer (ImageOps::lstm_forward/backward). `backend` provides the temporaries.
void lstm_forward(const CudaContext& ctx, Backend& backend, Tensor out, Tensor saved, Tensor inp,
                  Tensor weight_ih, Tensor weight_hh, Tensor bias_ih, Tensor bias_hh);
void lstm_backward(const CudaContext& ctx, Backend& backend, Tensor dinp, Tensor dweight_ih,
                   Tensor dweight_hh, Tensor dbias_ih, Tensor dbias_hh, Tensor dout, Tensor inp,
                   Tensor out, Tensor saved, Tensor weight_ih, Tensor weight_hh);

// ---- cuda_image_ops.cu --------------------------------------------------------------------------

/// The CUDA backend's ImageOps over `ctx` (owned by `backend`, which outlives it).
std::unique_ptr<ImageOps> make_cuda_image_ops(const CudaContext& ctx, Backend& backend);

}  // namespace shardtrain::cuda
