// Depthwise convolution (groups = C = K: MobileNetV2's and EfficientNet's 3×3 and 5×5 spatial
// filters) as direct kernels, NCHW. cuDNN's legacy API runs a grouped convolution with one group
// per channel far below memory speed; these kernels are memory-bound loops:
//   forward       one thread per output element, the R×S window from the input plane
//   input grad    one thread per input element, gathering the outputs whose window covers it
//                 (no atomics)
//   weight grad   grid (channel × image group): each thread sums its share of the R·S products
//                 in registers, the block reduces them, a second kernel adds the groups' partials
//                 in order (deterministic) to the accumulated gradient
// fp32 accumulation for every dtype.

#include "backend/cuda/cuda_image.h"

namespace shardtrain::cuda {
namespace {

struct Geom {
  int64_t N, C, H, W, P, Q, R, S, sh, sw, ph, pw;
};

template <typename T, int kR, int kS>
__global__ void depthwise_forward_kernel(T* out, const T* x, const T* w, Geom g, int64_t n) {
  const int R = kR > 0 ? kR : static_cast<int>(g.R), S = kS > 0 ? kS : static_cast<int>(g.S);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t q = i % g.Q, p = (i / g.Q) % g.P, nc = i / (g.P * g.Q), c = nc % g.C;
    const T* plane = x + nc * g.H * g.W;
    const T* wc = w + c * R * S;
    float acc = 0.0f;
    for (int r = 0; r < R; ++r) {
      const int64_t ih = p * g.sh - g.ph + r;
      if (ih < 0 || ih >= g.H) continue;
#pragma unroll 5
      for (int s = 0; s < S; ++s) {
        const int64_t iw = q * g.sw - g.pw + s;
        if (iw >= 0 && iw < g.W) acc += to_float(plane[ih * g.W + iw]) * to_float(wc[r * S + s]);
      }
    }
    out[i] = from_float<T>(acc);
  }
}

template <typename T>
__global__ void depthwise_input_grad_kernel(T* dx, const T* dy, const T* w, Geom g, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t iw = i % g.W, ih = (i / g.W) % g.H, nc = i / (g.H * g.W), c = nc % g.C;
    const T* dplane = dy + nc * g.P * g.Q;
    const T* wc = w + c * g.R * g.S;
    float acc = 0.0f;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t ph = ih + g.ph - r;  // = p·sh
      if (ph < 0 || ph % g.sh != 0) continue;
      const int64_t p = ph / g.sh;
      if (p >= g.P) continue;
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t qw = iw + g.pw - s;
        if (qw < 0 || qw % g.sw != 0) continue;
        const int64_t q = qw / g.sw;
        if (q < g.Q) acc += to_float(dplane[p * g.Q + q]) * to_float(wc[r * g.S + s]);
      }
    }
    dx[i] = from_float<T>(acc);
  }
}

constexpr int kMaxTaps = 49;  // R·S up to 7×7

/// part [G, C, R·S] fp32: channel blockIdx.x's products over image group blockIdx.y. kR, kS > 0
/// fix the window at compile time so the R·S sums stay in registers (0: any window ≤ 7×7).
template <typename T, int kR, int kS>
__global__ void depthwise_weight_partial_kernel(float* part, const T* dy, const T* x, Geom g) {
  constexpr int kTaps = kR > 0 ? kR * kS : kMaxTaps;
  __shared__ float shared[32];
  const int R = kR > 0 ? kR : static_cast<int>(g.R), S = kS > 0 ? kS : static_cast<int>(g.S);
  const int64_t c = blockIdx.x, G = gridDim.y, grp = blockIdx.y;
  const int64_t n0 = g.N * grp / G, n1 = g.N * (grp + 1) / G, PQ = g.P * g.Q;
  float acc[kTaps];
#pragma unroll
  for (int k = 0; k < kTaps; ++k) acc[k] = 0.0f;
  for (int64_t j = threadIdx.x; j < (n1 - n0) * PQ; j += blockDim.x) {
    const int64_t n = n0 + j / PQ, pq = j % PQ, p = pq / g.Q, q = pq % g.Q;
    const float d = to_float(dy[(n * g.C + c) * PQ + pq]);
    const T* plane = x + (n * g.C + c) * g.H * g.W;
#pragma unroll
    for (int r = 0; r < R; ++r) {  // R, S are constants when kR, kS are given: fully unrolled
      const int64_t ih = p * g.sh - g.ph + r;
      const bool row_ok = ih >= 0 && ih < g.H;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int64_t iw = q * g.sw - g.pw + s;
        if (row_ok && iw >= 0 && iw < g.W) acc[r * S + s] += d * to_float(plane[ih * g.W + iw]);
      }
    }
  }
  const int taps = R * S;
  for (int k = 0; k < taps; ++k) {
    const float v = block_sum(k < kTaps ? acc[k] : 0.0f, shared);
    if (threadIdx.x == 0) part[(grp * g.C + c) * taps + k] = v;
  }
}

/// dweight [C, R·S] += Σ_groups part, in group order.
template <typename T>
__global__ void depthwise_weight_finish_kernel(T* dw, const float* part, int64_t G, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  float acc = 0.0f;
  for (int64_t grp = 0; grp < G; ++grp) acc += part[grp * n + i];
  dw[i] = from_float<T>(to_float(dw[i]) + acc);
}

Geom geom(const Conv2dShape& s) {
  return {s.N, s.C, s.H, s.W, s.P(), s.Q(), s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w};
}

}  // namespace

bool is_depthwise(const Conv2dShape& s) {
  return s.groups > 1 && s.groups == s.C && s.K == s.C && s.R * s.S <= kMaxTaps;
}

void depthwise_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                       const Conv2dShape& s) {
  const Geom g = geom(s);
  const int64_t n = out.numel();
  dispatch_float(inp.dtype, [&]<typename T>() {
    const unsigned grid = grid_for(ctx, n);
    if (s.R == 3 && s.S == 3)
      depthwise_forward_kernel<T, 3, 3>
          <<<grid, kImageBlock, 0, ctx.stream>>>(out.as<T>(), inp.as<T>(), weight.as<T>(), g, n);
    else if (s.R == 5 && s.S == 5)
      depthwise_forward_kernel<T, 5, 5>
          <<<grid, kImageBlock, 0, ctx.stream>>>(out.as<T>(), inp.as<T>(), weight.as<T>(), g, n);
    else
      depthwise_forward_kernel<T, 0, 0>
          <<<grid, kImageBlock, 0, ctx.stream>>>(out.as<T>(), inp.as<T>(), weight.as<T>(), g, n);
  });
  ST_CUDA_LAUNCH_CHECK();
}

void depthwise_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                        Tensor inp, Tensor weight, const Conv2dShape& s) {
  const Geom g = geom(s);
  const int64_t taps = s.R * s.S;
  const int64_t G = image_groups(ctx, s.N, s.C, s.P() * s.Q());
  auto* part = static_cast<float*>(ctx.get_scratch(static_cast<size_t>(G * s.C * taps) * 4));
  dispatch_float(inp.dtype, [&]<typename T>() {
    const dim3 grid(static_cast<unsigned>(s.C), static_cast<unsigned>(G));
    if (s.R == 3 && s.S == 3)
      depthwise_weight_partial_kernel<T, 3, 3>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else if (s.R == 5 && s.S == 5)
      depthwise_weight_partial_kernel<T, 5, 5>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else
      depthwise_weight_partial_kernel<T, 0, 0>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    ST_CUDA_LAUNCH_CHECK();
    depthwise_weight_finish_kernel<T>
        <<<ceil_div(static_cast<size_t>(s.C * taps), kImageBlock), kImageBlock, 0, ctx.stream>>>(
            dweight.as<T>(), part, G, s.C * taps);
    ST_CUDA_LAUNCH_CHECK();
    if (!dinp.empty()) {
      const int64_t n = dinp.numel();
      depthwise_input_grad_kernel<T><<<grid_for(ctx, n), kImageBlock, 0, ctx.stream>>>(
          dinp.as<T>(), dout.as<T>(), weight.as<T>(), g, n);
      ST_CUDA_LAUNCH_CHECK();
    }
  });
}

}  // namespace shardtrain::cuda
