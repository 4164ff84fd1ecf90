// Convolution on the GPU through cuDNN's convolution API (cudnnConvolutionForward,
// cudnnConvolutionBackwardData, cudnnConvolutionBackwardFilter), NCHW tensors, grouped
// convolutions through the group count; depthwise ones go to cuda_depthwise.cu's direct kernels.
//
// Algorithms: the first time a geometry is seen, cuDNN times its algorithms once
// (cudnnFind*Algorithm, the equivalent of PyTorch's torch.backends.cudnn.benchmark = True) and the
// fastest one whose workspace fits kMaxWorkspace is kept for that geometry; later calls only
// enqueue. In bf16/fp16 the fastest gradient algorithms may sum with atomics, so image-model
// gradients on the GPU are not bit-identical run to run (as PyTorch's default,
// cudnn.deterministic = False; the deterministic ones were up to 10× slower in the backward
// pass, H100, 2026-11-24). The fp32 testing mode takes only deterministic, exact algorithms.
//
// Precision: bf16/fp16 tensors with fp32 accumulation on tensor cores (CUDNN_TENSOR_OP_MATH);
// fp32 tensors with plain fp32 FMA (no TF32), so the fp32 backend matches the CPU reference.
// Bias and activation run as one element-wise pass after the convolution.
#include <cudnn.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "backend/cuda/cuda_image.h"

namespace shardtrain::cuda {
namespace {

/// The most workspace (bytes) an algorithm may take: it is held as long as the backend's scratch
/// lives, so it counts against peak memory; faster algorithms that need more are passed over.
constexpr size_t kMaxWorkspace = size_t{64} << 20;

void throw_cudnn_error(cudnnStatus_t st, const char* expr, const char* file, int line) {
  throw RuntimeFailure(std::string("cuDNN call ") + expr + " failed: " + cudnnGetErrorString(st) +
                       " (" + file + ":" + std::to_string(line) + ")");
}

#define ST_CUDNN_CHECK(expr)                                                                \
  do {                                                                                      \
    cudnnStatus_t st_s_ = (expr);                                                           \
    if (st_s_ != CUDNN_STATUS_SUCCESS) throw_cudnn_error(st_s_, #expr, __FILE__, __LINE__); \
  } while (0)

cudnnDataType_t cudnn_dtype(DType dt) {
  switch (dt) {
    case DType::kF32:
      return CUDNN_DATA_FLOAT;
    case DType::kBF16:
      return CUDNN_DATA_BFLOAT16;
    case DType::kF16:
      return CUDNN_DATA_HALF;
    default:
      throw RuntimeFailure(std::string("cuda conv2d: dtype ") + dtype_name(dt) +
                           " is not fp32, bf16 or fp16");
  }
}

/// One geometry's descriptors and chosen algorithms (found on first use of each direction).
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  /// The algorithm chosen for one direction, its workspace (bytes) and the math type it was timed
  /// with: set on `conv` before running it (cuDNN rejects an algorithm run under another math
  /// type with CUDNN_STATUS_BAD_PARAM).
  template <typename A>
  struct Choice {
    bool found = false;
    A algo{};
    size_t ws = 0;
    cudnnMathType_t math{};
  };
  Choice<cudnnConvolutionFwdAlgo_t> fwd;
  Choice<cudnnConvolutionBwdDataAlgo_t> bwd_data;
  Choice<cudnnConvolutionBwdFilterAlgo_t> bwd_filter;
  bool nhwc = false;  ///< descriptors in channels-last layout (see channels_last())

  ConvPlan(const Conv2dShape& s, DType dt, bool channels_last) : nhwc(channels_last) {
    const cudnnDataType_t t = cudnn_dtype(dt);
    const cudnnTensorFormat_t f = nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    auto i = [](int64_t v) { return static_cast<int>(v); };
    ST_CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
    ST_CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
    ST_CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    ST_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    ST_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x, f, t, i(s.N), i(s.C), i(s.H), i(s.W)));
    ST_CUDNN_CHECK(cudnnSetTensor4dDescriptor(y, f, t, i(s.N), i(s.K), i(s.P()), i(s.Q())));
    ST_CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, t, f, i(s.K), i(s.C / s.groups), i(s.R), i(s.S)));
    ST_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv, i(s.pad_h), i(s.pad_w), i(s.stride_h),
                                                   i(s.stride_w), 1, 1, CUDNN_CROSS_CORRELATION,
                                                   CUDNN_DATA_FLOAT));
    ST_CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv, i(s.groups)));
    ST_CUDNN_CHECK(cudnnSetConvolutionMathType(
        conv, dt == DType::kF32 ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH));
  }
  ~ConvPlan() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
  ConvPlan(const ConvPlan&) = delete;
  ConvPlan& operator=(const ConvPlan&) = delete;
};

/// Whether an algorithm computes the convolution exactly as a sum of products (GEMM-like or
/// direct) rather than through a transform (FFT, Winograd) whose rounding is larger: fp32 runs
/// (the testing mode, held to the CPU reference) take only those.
bool exact_algo(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
bool exact_algo(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
}
bool exact_algo(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

/// The fastest result (cuDNN sorts by time) that ran, fits the workspace cap, is deterministic
/// when asked and exact (exact_algo) in fp32; fp32 also refuses TF32 tensor-core math.
template <typename Perf>
const Perf* pick(const Perf* perf, int n, bool need_deterministic, DType dt) {
  for (int k = 0; k < n; ++k) {
    if (perf[k].status != CUDNN_STATUS_SUCCESS || perf[k].memory > kMaxWorkspace) continue;
    if (need_deterministic && perf[k].determinism != CUDNN_DETERMINISTIC) continue;
    if (dt == DType::kF32 && (!exact_algo(perf[k].algo) || perf[k].mathType != CUDNN_FMA_MATH))
      continue;
    return &perf[k];
  }
  return nullptr;
}

std::string geometry_str(const Conv2dShape& s, DType dt) {
  auto v = [](int64_t x) { return std::to_string(x); };
  return "input [" + v(s.N) + ", " + v(s.C) + ", " + v(s.H) + ", " + v(s.W) + "], weight [" +
         v(s.K) + ", " + v(s.C / s.groups) + ", " + v(s.R) + ", " + v(s.S) + "], stride " +
         v(s.stride_h) + "x" + v(s.stride_w) + ", pad " + v(s.pad_h) + "x" + v(s.pad_w) +
         ", groups " + v(s.groups) + ", " + dtype_name(dt);
}

/// Whether a convolution runs channels-last: bf16/fp16 without groups. cuDNN's tensor-core
/// kernels work in NHWC; given NCHW tensors they ran several times slower than the transposes to
/// and from NHWC cost (H100, 2026-11-24), so the runner transposes around them. fp32 (the testing
/// mode) stays NCHW.
bool channels_last(const Conv2dShape& s, DType dt) { return dt != DType::kF32 && s.groups == 1; }

/// Whether `s` is a pointwise convolution (1×1, stride 1, no padding, no groups) in bf16/fp16 with
/// channel counts that keep GEMM rows 16-byte aligned: it runs as one GEMM over the pixels in
/// channels-last order, out [N·H·W, K] = x [N·H·W, C] · weight [K, C]ᵀ (the backend's cuBLASLt
/// matmul), instead of through cuDNN. MobileNetV2's and EfficientNet's expand and project layers
/// are such convolutions; cuDNN's legacy API chose non-tensor-core kernels for them whose
/// backward took 1–1.7 ms per call at batch 256 (32×32) and 64 (224×224) — 80% of MobileNetV2's
/// step (H100, cuDNN 9.19, 2026-11-24; bench/kernel_trace.cpp).
bool pointwise_gemm(const Conv2dShape& s, DType dt) {
  return dt != DType::kF32 && s.groups == 1 && s.R == 1 && s.S == 1 && s.stride_h == 1 &&
         s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0 && s.C % 8 == 0 && s.K % 8 == 0;
}

/// Whether a first layer's weight gradient (no input gradient wanted) runs as im2col + one GEMM:
/// channels-last bf16/fp16 with a channel count tensor cores cannot take (C % 8 ≠ 0: gray or RGB
/// input), while the column matrix stays small (≤ 16 MiB). cuDNN's legacy API ran these with its
/// non-tensor-core wgrad_alg0 kernel at ~1.2 ms a call for Fashion-MNIST's 1-channel 32×32 input
/// at batch 256 — a fifth to a half of a small model's step (H100, bench/kernel_trace.cpp); for
/// 224×224 RGB it picked tensor-core kernels (0.07 ms), where the columns would be 51–205 MB.
bool im2col_weight_gradient(const Conv2dShape& s, DType dt, bool nhwc, bool need_dinp) {
  const int64_t cols = (s.C * s.R * s.S + 7) / 8 * 8;
  return nhwc && !need_dinp && dt != DType::kF32 && s.groups == 1 && s.C % 8 != 0 &&
         s.N * s.P() * s.Q() * cols * 2 <= (int64_t{16} << 20);
}

/// cols [N·P·Q, Kc] = the R×S×C window of each output pixel of the channels-last image x, column
/// j = (c·R + r)·S + s (the KCRS weight's order), zero beyond C·R·S and outside the image.
template <typename T>
__global__ void im2col_nhwc_kernel(T* cols, const T* x, Conv2dShape s, int64_t P, int64_t Q,
                                   int64_t Kc, int64_t n) {
  const int64_t taps = s.R * s.S;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = idiv(i, Kc), j = i - row * Kc;
    float v = 0.0f;
    if (j < s.C * taps) {
      const int64_t c = j / taps, r = (j / s.S) % s.R, t = j % s.S;
      const int64_t q = imod(row, Q), p = imod(idiv(row, Q), P), b = idiv(row, P * Q);
      const int64_t ih = p * s.stride_h - s.pad_h + r, iw = q * s.stride_w - s.pad_w + t;
      if (ih >= 0 && ih < s.H && iw >= 0 && iw < s.W)
        v = to_float(x[((b * s.H + ih) * s.W + iw) * s.C + c]);
    }
    cols[i] = from_float<T>(v);
  }
}

/// dweight [K, CRS] += part [K, Kc] fp32 (its first CRS columns).
template <typename T>
__global__ void add_columns_kernel(T* dweight, const float* part, int64_t CRS, int64_t Kc,
                                   int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t k = i / CRS, j = i % CRS;
    dweight[i] = from_float<T>(to_float(dweight[i]) + part[k * Kc + j]);
  }
}

/// Times one direction's algorithms once (`find(count, &n, perf)`: a cudnnFind*Algorithm call)
/// and keeps pick()'s choice in `c`; throws naming `what` and the geometry when none qualifies.
template <typename Perf, int kCount, typename Choice, typename Find>
void choose(Choice& c, cudnnConvolutionDescriptor_t conv, Find&& find, bool deterministic, DType dt,
            const char* what, const Conv2dShape& s) {
  if (c.found) return;
  // The search runs under the descriptor's math type, which the last run direction left at its
  // own choice; tensor-core math admits every algorithm (each result names the math it used).
  ST_CUDNN_CHECK(
      cudnnSetConvolutionMathType(conv, dt == DType::kF32 ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH));
  Perf perf[kCount];
  int n = 0;
  // Twice: with CUDA's lazy module loading (the default) the first search's timings include
  // loading each candidate's kernels, which made cuDNN keep its legacy non-tensor-core kernels
  // (already loaded by an earlier search) for 3×3 weight gradients at 1.2 ms a call.
  ST_CUDNN_CHECK(find(kCount, &n, perf));
  ST_CUDNN_CHECK(find(kCount, &n, perf));
  const Perf* best = pick(perf, n, deterministic, dt);
  require(best != nullptr, "cuda ", what, ": cuDNN has no algorithm for ", geometry_str(s, dt));
  c.algo = best->algo;
  c.ws = best->memory;
  c.math = best->mathType;
  c.found = true;
}

class CudnnConvRunner final : public ConvRunner {
 public:
  CudnnConvRunner(const CudaContext& ctx, Backend& backend) : ctx_(ctx), backend_(backend) {
    ST_CUDNN_CHECK(cudnnCreate(&handle_));
    ST_CUDNN_CHECK(cudnnSetStream(handle_, ctx_.stream));
  }
  ~CudnnConvRunner() override {
    plans_.clear();
    if (handle_) cudnnDestroy(handle_);
  }

  void forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const Conv2dShape& s,
               Activation act, bool nhwc) override {
    const int64_t PQ = s.P() * s.Q();
    if (is_depthwise(s)) {
      depthwise_forward(ctx_, out, inp, weight, s, nhwc);
    } else if (pointwise_gemm(s, inp.dtype)) {
      pointwise_forward(out, inp, weight, s, nhwc);
    } else {
      ConvPlan& p = plan(s, inp.dtype, nhwc);
      choose<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
          p.fwd, p.conv,
          [&](int k, int* n, cudnnConvolutionFwdAlgoPerf_t* perf) {
            return cudnnFindConvolutionForwardAlgorithm(handle_, p.x, p.w, p.conv, p.y, k, n, perf);
          },
          false, inp.dtype, "conv2d_forward", s);
      const float one = 1.0f, zero = 0.0f;
      std::optional<Temp> x, w, y;
      const Tensor xo = to_plan(x, inp, nhwc, p.nhwc, s.N, s.C, s.H * s.W);
      const Tensor wo = weight_to_plan(w, weight, p.nhwc, s);
      const Tensor yo = plan_output(y, out, nhwc, p.nhwc);
      ST_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, p.fwd.math));
      ST_CUDNN_CHECK(cudnnConvolutionForward(handle_, &one, p.x, xo.data, p.w, wo.data, p.conv,
                                             p.fwd.algo, workspace(p.fwd.ws), p.fwd.ws, &zero, p.y,
                                             yo.data));
      from_plan(out, yo, nhwc, p.nhwc, s.N, s.K, PQ);
    }
    if (!bias.empty() || act != Activation::kNone)
      bias_activation(ctx_, out, bias, s.K, PQ, act, nhwc);
  }

  void backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                const Conv2dShape& s, bool nhwc) override {
    if (!dbias.empty()) bias_gradient(ctx_, dbias, dout, s.N, s.K, s.P() * s.Q(), nhwc);
    if (is_depthwise(s)) {
      depthwise_backward(ctx_, dinp, dweight, dout, inp, weight, s, nhwc);
      return;
    }
    if (pointwise_gemm(s, inp.dtype)) {
      pointwise_backward(dinp, dweight, dout, inp, weight, s, nhwc);
      return;
    }
    if (im2col_weight_gradient(s, inp.dtype, nhwc, !dinp.empty())) {
      im2col_backward(dweight, dout, inp, s);
      return;
    }
    ConvPlan& p = plan(s, inp.dtype, nhwc);
    const float one = 1.0f, zero = 0.0f;
    const bool deterministic = inp.dtype == DType::kF32;
    choose<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
        p.bwd_filter, p.conv,
        [&](int k, int* n, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
          return cudnnFindConvolutionBackwardFilterAlgorithm(handle_, p.x, p.y, p.conv, p.w, k, n,
                                                             perf);
        },
        deterministic, inp.dtype, "conv2d_backward (weight gradient)", s);
    // The operands in the plan's layout: transposed copies where it differs from the images'
    // (or, for the weight, from PyTorch's KCRS), else the tensors themselves.
    std::optional<Temp> x, dy, w, dw, dx;
    const Tensor xo = to_plan(x, inp, nhwc, p.nhwc, s.N, s.C, s.H * s.W);
    const Tensor dyo = to_plan(dy, dout, nhwc, p.nhwc, s.N, s.K, s.P() * s.Q());
    const Tensor dwo = weight_to_plan(dw, dweight, p.nhwc, s);
    // β = 1: weight gradients accumulate over micro-batches.
    ST_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, p.bwd_filter.math));
    ST_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
        handle_, &one, p.x, xo.data, p.y, dyo.data, p.conv, p.bwd_filter.algo,
        workspace(p.bwd_filter.ws), p.bwd_filter.ws, &one, p.w, dwo.data));
    if (p.nhwc) batched_transpose(ctx_, dweight, dwo, s.K, s.R * s.S, s.C / s.groups);
    if (dinp.empty()) return;
    choose<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
        p.bwd_data, p.conv,
        [&](int k, int* n, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
          return cudnnFindConvolutionBackwardDataAlgorithm(handle_, p.w, p.y, p.conv, p.x, k, n,
                                                           perf);
        },
        deterministic, inp.dtype, "conv2d_backward (input gradient)", s);
    const Tensor wo = weight_to_plan(w, weight, p.nhwc, s);
    const Tensor dxo = plan_output(dx, dinp, nhwc, p.nhwc);
    ST_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, p.bwd_data.math));
    ST_CUDNN_CHECK(cudnnConvolutionBackwardData(handle_, &one, p.w, wo.data, p.y, dyo.data, p.conv,
                                                p.bwd_data.algo, workspace(p.bwd_data.ws),
                                                p.bwd_data.ws, &zero, p.x, dxo.data));
    from_plan(dinp, dxo, nhwc, p.nhwc, s.N, s.C, s.H * s.W);
  }

 private:
  /// An image of B × C channels × HW pixels in the plan's layout: `src` itself when it is already
  /// (`act_nhwc` == `plan_nhwc`), else a transposed copy in `t`.
  Tensor to_plan(std::optional<Temp>& t, const Tensor& src, bool act_nhwc, bool plan_nhwc,
                 int64_t B, int64_t C, int64_t HW) {
    if (act_nhwc == plan_nhwc) return src;
    t.emplace(backend_, src.dtype, std::initializer_list<int64_t>{B, C * HW});
    if (plan_nhwc)
      batched_transpose(ctx_, **t, src, B, C, HW);
    else
      batched_transpose(ctx_, **t, src, B, HW, C);
    return **t;
  }
  /// Where cuDNN writes an image result: `dst` itself when the layouts agree, else a temporary
  /// that from_plan() transposes into `dst`.
  Tensor plan_output(std::optional<Temp>& t, const Tensor& dst, bool act_nhwc, bool plan_nhwc) {
    if (act_nhwc == plan_nhwc) return dst;
    t.emplace(backend_, dst.dtype, std::initializer_list<int64_t>{dst.numel()});
    return **t;
  }
  void from_plan(Tensor dst, const Tensor& res, bool act_nhwc, bool plan_nhwc, int64_t B, int64_t C,
                 int64_t HW) {
    if (act_nhwc == plan_nhwc) return;
    if (plan_nhwc)
      batched_transpose(ctx_, dst, res, B, HW, C);
    else
      batched_transpose(ctx_, dst, res, B, C, HW);
  }
  /// A weight [K, C/g, R, S] in the plan's filter layout (KRSC copy for a channels-last plan).
  Tensor weight_to_plan(std::optional<Temp>& t, const Tensor& w, bool plan_nhwc,
                        const Conv2dShape& s) {
    return to_plan(t, w, false, plan_nhwc, s.K, s.C / s.groups, s.R * s.S);
  }

  /// im2col_weight_gradient()'s path: dweight += doutᵀ [K, N·P·Q] · cols [N·P·Q, Kc] through the
  /// backend's matmul into an fp32 [K, Kc] temporary, whose first C·R·S columns are added.
  void im2col_backward(Tensor dweight, Tensor dout, Tensor inp, const Conv2dShape& s) {
    const DType dt = inp.dtype;
    const int64_t CRS = s.C * s.R * s.S, Kc = (CRS + 7) / 8 * 8, M = s.N * s.P() * s.Q();
    Temp cols(backend_, dt, {M, Kc}), part(backend_, DType::kF32, {s.K, Kc});
    ST_CUDA_CHECK(cudaMemsetAsync((*part).data, 0, (*part).bytes(), ctx_.stream));
    dispatch_float(dt, [&]<typename T>() {
      im2col_nhwc_kernel<T><<<grid_for(ctx_, M * Kc), kImageBlock, 0, ctx_.stream>>>(
          (*cols).as<T>(), inp.as<T>(), s, s.P(), s.Q(), Kc, M * Kc);
    });
    ST_CUDA_LAUNCH_CHECK();
    // The weight operand only gives the GEMM its shape when no input gradient is asked for.
    const Tensor shape_only(nullptr, dt, DeviceKind::kCUDA, {s.K, Kc});
    backend_.matmul_backward({}, *part, {}, dout.reshape({M, s.K}), *cols, shape_only);
    dispatch_float(dt, [&]<typename T>() {
      add_columns_kernel<T><<<grid_for(ctx_, s.K * CRS), kImageBlock, 0, ctx_.stream>>>(
          dweight.as<T>(), (*part).as<float>(), CRS, Kc, s.K * CRS);
    });
    ST_CUDA_LAUNCH_CHECK();
  }

  /// pointwise_gemm()'s forward: one GEMM over the pixels, with channels-last copies of the
  /// input and output for NCHW images (none when H·W = 1, where NCHW and NHWC coincide).
  void pointwise_forward(Tensor out, Tensor inp, Tensor weight, const Conv2dShape& s, bool nhwc) {
    const DType dt = inp.dtype;
    const int64_t HW = s.H * s.W, M = s.N * HW;
    const Tensor w = weight.reshape({s.K, s.C});
    if (HW == 1 || nhwc) {
      backend_.matmul_forward(out.reshape({M, s.K}), inp.reshape({M, s.C}), w, {});
      return;
    }
    Temp x(backend_, dt, {M, s.C}), y(backend_, dt, {M, s.K});
    batched_transpose(ctx_, *x, inp, s.N, s.C, HW);
    backend_.matmul_forward(*y, *x, w, {});
    batched_transpose(ctx_, out, *y, s.N, HW, s.K);
  }
  /// pointwise_gemm()'s backward: dinp = dout · weight, dweight += doutᵀ · inp over the pixels.
  void pointwise_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                          const Conv2dShape& s, bool nhwc) {
    const DType dt = inp.dtype;
    const int64_t HW = s.H * s.W, M = s.N * HW;
    const Tensor w = weight.reshape({s.K, s.C}), dw = dweight.reshape({s.K, s.C});
    if (HW == 1 || nhwc) {
      backend_.matmul_backward(dinp.empty() ? Tensor() : dinp.reshape({M, s.C}), dw, {},
                               dout.reshape({M, s.K}), inp.reshape({M, s.C}), w);
      return;
    }
    Temp x(backend_, dt, {M, s.C}), dy(backend_, dt, {M, s.K});
    batched_transpose(ctx_, *x, inp, s.N, s.C, HW);
    batched_transpose(ctx_, *dy, dout, s.N, s.K, HW);
    if (dinp.empty()) {
      backend_.matmul_backward({}, dw, {}, *dy, *x, w);
      return;
    }
    Temp dx(backend_, dt, {M, s.C});
    backend_.matmul_backward(*dx, dw, {}, *dy, *x, w);
    batched_transpose(ctx_, dinp, *dx, s.N, HW, s.C);
  }

  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int>;

  /// The plan of a geometry: channels-last for channels-last images without groups (cuDNN's
  /// grouped convolutions stay NCHW) and where channels_last() asks for it.
  ConvPlan& plan(const Conv2dShape& s, DType dt, bool nhwc_images) {
    const bool plan_nhwc = (nhwc_images && s.groups == 1) || channels_last(s, dt);
    const Key key{s.N,
                  s.C,
                  s.H,
                  s.W,
                  s.K,
                  s.R,
                  s.S,
                  s.stride_h,
                  s.stride_w,
                  s.pad_h,
                  s.pad_w,
                  s.groups,
                  static_cast<int>(dt) * 2 + (plan_nhwc ? 1 : 0)};
    auto it = plans_.find(key);
    if (it == plans_.end())
      it = plans_.emplace(key, std::make_unique<ConvPlan>(s, dt, plan_nhwc)).first;
    return *it->second;
  }
  void* workspace(size_t bytes) { return bytes == 0 ? nullptr : ctx_.get_scratch(bytes); }

  const CudaContext& ctx_;
  Backend& backend_;
  cudnnHandle_t handle_ = nullptr;
  std::map<Key, std::unique_ptr<ConvPlan>> plans_;
};

// ---- bias and activation epilogue, bias gradient ------------------------------------------------

template <typename T, Activation A>
__global__ void bias_activation_kernel(T* out, const T* bias, int64_t n, int64_t K, int64_t PQ,
                                       bool nhwc) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float v = to_float(out[i]);
    if (bias) v += to_float(bias[nhwc ? imod(i, K) : imod(idiv(i, PQ), K)]);
    out[i] = from_float<T>(act_forward<A>(v));
  }
}

/// bias_activation_kernel on channels-last images, 8 channels per thread (K % 8 == 0).
template <typename T, Activation A>
__global__ void bias_activation_vec8_kernel(T* out, const T* bias, int64_t n8, int64_t K) {
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8, k0 = imod(i, K);
    float o[8];
    load8(out + i, o);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      o[k] = act_forward<A>(o[k] + (bias ? to_float(bias[k0 + k]) : 0.0f));
    store8(out + i, o);
  }
}

/// Block (k, group): Σ over the group's images of channel k's PQ values into part [G, K] fp32
/// (grid K × G, image_groups(): one block per channel left most SMs idle on VGG's 64-channel
/// layers at 224×224 — 17 ms of its step).
template <typename T>
__global__ void bias_gradient_partial_kernel(float* part, const T* dout, int64_t N, int64_t K,
                                             int64_t PQ) {
  __shared__ float shared[32];
  const int64_t k = blockIdx.x, G = gridDim.y, grp = blockIdx.y;
  const int64_t n0 = N * grp / G, n1 = N * (grp + 1) / G;
  float acc = 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const T* plane = dout + (n * K + k) * PQ;
    for (int64_t j = threadIdx.x; j < PQ; j += blockDim.x) acc += to_float(plane[j]);
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) part[grp * K + k] = acc;
}

/// Channels-last: part [G, K] = Σ over the rows (n, pq) of group blockIdx.y of dout [N·PQ, K]
/// (threads kColTile channels × kColRows rows).
template <typename T>
__global__ void bias_gradient_columns_kernel(float* part, const T* dout, int64_t rows, int64_t K) {
  __shared__ float tile[kColRows][kColTile];
  const int64_t k = blockIdx.x * int64_t{kColTile} + threadIdx.x, G = gridDim.y;
  const int64_t r0 = rows * blockIdx.y / G, r1 = rows * (blockIdx.y + 1) / G;
  float acc = 0.0f;
  if (k < K)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) acc += to_float(dout[r * K + k]);
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || k >= K) return;
  for (unsigned r = 1; r < kColRows; ++r) acc += tile[r][threadIdx.x];
  part[blockIdx.y * K + k] = acc;
}

/// dst [b, y, x] = src [b, x, y] for matrix b = blockIdx.z: 32×32 tiles through shared memory
/// (padded against bank conflicts), so reads and writes are both coalesced.
template <typename T>
__global__ void transpose_kernel(T* dst, const T* src, int64_t X, int64_t Y) {
  __shared__ T tile[32][33];
  const int64_t b = blockIdx.z, x0 = blockIdx.y * 32, y0 = blockIdx.x * 32;
  const T* s = src + b * X * Y;
  T* d = dst + b * X * Y;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t x = x0 + k, y = y0 + threadIdx.x;
    if (x < X && y < Y) tile[k][threadIdx.x] = s[x * Y + y];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t y = y0 + k, x = x0 + threadIdx.x;
    if (x < X && y < Y) d[y * X + x] = tile[threadIdx.x][k];
  }
}

}  // namespace

std::unique_ptr<ConvRunner> make_conv_runner(const CudaContext& ctx, Backend& backend) {
  return std::make_unique<CudnnConvRunner>(ctx, backend);
}

void batched_transpose(const CudaContext& ctx, Tensor dst, Tensor src, int64_t B, int64_t X,
                       int64_t Y) {
  const dim3 block(32, 8);
  const dim3 grid(ceil_div(static_cast<size_t>(Y), 32), ceil_div(static_cast<size_t>(X), 32),
                  static_cast<unsigned>(B));
  dispatch_float(src.dtype, [&]<typename T>() {
    transpose_kernel<T><<<grid, block, 0, ctx.stream>>>(dst.as<T>(), src.as<T>(), X, Y);
  });
  ST_CUDA_LAUNCH_CHECK();
}

void bias_activation(const CudaContext& ctx, Tensor out, Tensor bias, int64_t K, int64_t PQ,
                     Activation act, bool nhwc) {
  const int64_t n = out.numel();
  const bool vec = vec8_ok(nhwc, K, {out.data});
  dispatch_float(out.dtype, [&]<typename T>() {
    dispatch_activation(act, [&]<Activation A>() {
      if (vec) {
        bias_activation_vec8_kernel<T, A><<<grid_for(ctx, n / 8), kImageBlock, 0, ctx.stream>>>(
            out.as<T>(), bias.empty() ? nullptr : bias.as<T>(), n / 8, K);
        return;
      }
      bias_activation_kernel<T, A><<<grid_for(ctx, n), kImageBlock, 0, ctx.stream>>>(
          out.as<T>(), bias.empty() ? nullptr : bias.as<T>(), n, K, PQ, nhwc);
    });
  });
  ST_CUDA_LAUNCH_CHECK();
}

void bias_gradient(const CudaContext& ctx, Tensor dbias, Tensor dout, int64_t N, int64_t K,
                   int64_t PQ, bool nhwc) {
  const int64_t G = nhwc ? column_groups(ctx, N * PQ, K) : image_groups(ctx, N, K, PQ);
  auto* part = static_cast<float*>(ctx.get_scratch(static_cast<size_t>(G * K) * sizeof(float)));
  dispatch_float(dout.dtype, [&]<typename T>() {
    if (nhwc)
      bias_gradient_columns_kernel<T>
          <<<dim3(ceil_div(static_cast<size_t>(K), kColTile), static_cast<unsigned>(G)),
             dim3(kColTile, kColRows), 0, ctx.stream>>>(part, dout.as<T>(), N * PQ, K);
    else
      bias_gradient_partial_kernel<T><<<dim3(static_cast<unsigned>(K), static_cast<unsigned>(G)),
                                        kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), N, K, PQ);
    ST_CUDA_LAUNCH_CHECK();
    add_partial_sums(ctx.stream, dbias.as<T>(), part, G, K);
  });
  ST_CUDA_LAUNCH_CHECK();
}

}  // namespace shardtrain::cuda
