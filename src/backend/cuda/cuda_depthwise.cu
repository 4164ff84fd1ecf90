// Depthwise convolution (groups = C = K: MobileNetV2's and EfficientNet's 3×3 and 5×5 spatial
// filters) as direct kernels on NCHW or channels-last images, with 32-bit index arithmetic where
// the tensor allows. cuDNN's legacy API runs a grouped convolution with one group
// per channel far below memory speed; these kernels are memory-bound loops:
//   forward       one thread per output element, the R×S window from the input plane
//   input grad    one thread per input element, gathering the outputs whose window covers it
//                 (no atomics)
//   weight grad   grid (channel × image group): each thread sums its share of the R·S products
//                 in registers, the block reduces them, add_partial_sums adds the groups'
//                 partials in order (deterministic) to the accumulated gradient
// fp32 accumulation for every dtype.

#include "backend/cuda/cuda_image.h"

namespace shardtrain::cuda {
namespace {

struct Geom {
  int64_t N, C, H, W, P, Q, R, S, sh, sw, ph, pw;
};

/// The kernels' index type: 32-bit integer division is several times cheaper than 64-bit, and
/// index arithmetic dominated these memory-bound loops; tensors of 2^31 elements or more take the
/// 64-bit instantiation.
template <typename I>
struct G {
  I C, H, W, P, Q, sh, sw, ph, pw;
  bool nhwc;  ///< images channels-last
  /// Flat index of (n, c, h, w) in an image of `h_size` × `w_size` pixels.
  __device__ I at(I n, I c, I h, I w, I h_size, I w_size) const {
    return nhwc ? ((n * h_size + h) * w_size + w) * C + c : ((n * C + c) * h_size + h) * w_size + w;
  }
  /// (n, c, h, w) of flat index i in an image of `h_size` × `w_size` pixels.
  __device__ void coords(I i, I h_size, I w_size, I& n, I& c, I& h, I& w) const {
    if (nhwc) {
      c = i % C;
      const I t = i / C;
      w = t % w_size;
      h = (t / w_size) % h_size;
      n = t / (w_size * h_size);
    } else {
      w = i % w_size;
      h = (i / w_size) % h_size;
      const I nc = i / (w_size * h_size);
      c = nc % C;
      n = nc / C;
    }
  }
  G(const Geom& g, bool channels_last)
      : C(static_cast<I>(g.C)),
        H(static_cast<I>(g.H)),
        W(static_cast<I>(g.W)),
        P(static_cast<I>(g.P)),
        Q(static_cast<I>(g.Q)),
        sh(static_cast<I>(g.sh)),
        sw(static_cast<I>(g.sw)),
        ph(static_cast<I>(g.ph)),
        pw(static_cast<I>(g.pw)),
        nhwc(channels_last) {}
};

template <typename T, int kR, int kS, typename I>
__global__ void depthwise_forward_kernel(T* out, const T* x, const T* w, G<I> g, int R, int S,
                                         I n) {
  if constexpr (kR > 0) R = kR, S = kS;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    I b, c, p, q;
    g.coords(i, g.P, g.Q, b, c, p, q);
    const T* wc = w + c * R * S;
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const I ih = p * g.sh - g.ph + r;
      if (ih < 0 || ih >= g.H) continue;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const I iw = q * g.sw - g.pw + s;
        if (iw >= 0 && iw < g.W)
          acc += to_float(x[g.at(b, c, ih, iw, g.H, g.W)]) * to_float(wc[r * S + s]);
      }
    }
    out[i] = from_float<T>(acc);
  }
}

/// dx at (n, c, ih, iw) gathers the outputs (p, q) whose window covers it: p·sh = ih + ph − r for
/// the taps r ≡ ih + ph (mod sh), stepped by sh (no division per tap).
template <typename T, int kR, int kS, typename I>
__global__ void depthwise_input_grad_kernel(T* dx, const T* dy, const T* w, G<I> g, int R, int S,
                                            I n) {
  if constexpr (kR > 0) R = kR, S = kS;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    I b, c, ih, iw;
    g.coords(i, g.H, g.W, b, c, ih, iw);
    const T* wc = w + c * R * S;
    const I hh = ih + g.ph, ww = iw + g.pw;
    const int r0 = static_cast<int>(hh % g.sh), s0 = static_cast<int>(ww % g.sw);
    float acc = 0.0f;
    for (int r = r0; r < R; r += static_cast<int>(g.sh)) {
      if (hh < r) break;  // later taps lie further above the input
      const I p = (hh - r) / g.sh;
      if (p >= g.P) continue;
      for (int s = s0; s < S; s += static_cast<int>(g.sw)) {
        if (ww < s) break;
        const I q = (ww - s) / g.sw;
        if (q < g.Q) acc += to_float(dy[g.at(b, c, p, q, g.P, g.Q)]) * to_float(wc[r * S + s]);
      }
    }
    dx[i] = from_float<T>(acc);
  }
}

/// Channels-last forward, 8 channels of one output pixel per thread (C % 8 == 0): 16-byte loads
/// of the input, the per-channel weights from cache.
template <typename T, int kR, int kS>
__global__ void depthwise_forward_vec8_kernel(T* out, const T* x, const T* w, Geom g, int64_t n8) {
  const int R = kR > 0 ? kR : static_cast<int>(g.R), S = kS > 0 ? kS : static_cast<int>(g.S);
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8;
    int64_t b, c0, p, q;
    ImageIndex{g.C, g.P, g.Q, true}.coords(i, b, c0, p, q);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t ih = p * g.sh - g.ph + r;
      if (ih < 0 || ih >= g.H) continue;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int64_t iw = q * g.sw - g.pw + s;
        if (iw < 0 || iw >= g.W) continue;
        float xv[8];
        load8(x + ((b * g.H + ih) * g.W + iw) * g.C + c0, xv);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += xv[k] * to_float(w[(c0 + k) * R * S + r * S + s]);
      }
    }
    store8(out + i, acc);
  }
}

/// Channels-last input gradient, 8 channels of one input pixel per thread (C % 8 == 0).
template <typename T, int kR, int kS>
__global__ void depthwise_input_grad_vec8_kernel(T* dx, const T* dy, const T* w, Geom g,
                                                 int64_t n8) {
  const int R = kR > 0 ? kR : static_cast<int>(g.R), S = kS > 0 ? kS : static_cast<int>(g.S);
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8;
    int64_t b, c0, ih, iw;
    ImageIndex{g.C, g.H, g.W, true}.coords(i, b, c0, ih, iw);
    const int64_t hh = ih + g.ph, ww = iw + g.pw;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t r = imod(hh, g.sh); r < R && r <= hh; r += g.sh) {
      const int64_t p = idiv(hh - r, g.sh);
      if (p >= g.P) continue;
      for (int64_t s = imod(ww, g.sw); s < S && s <= ww; s += g.sw) {
        const int64_t q = idiv(ww - s, g.sw);
        if (q >= g.Q) continue;
        float dv[8];
        load8(dy + ((b * g.P + p) * g.Q + q) * g.C + c0, dv);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += dv[k] * to_float(w[(c0 + k) * R * S + r * S + s]);
      }
    }
    store8(dx + i, acc);
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
  // Pixel arithmetic in 32 bits (a group's N·P·Q values and a plane's H·W are < 2^31), the
  // plane offsets in 64.
  const int Q = static_cast<int>(g.Q), H = static_cast<int>(g.H), W = static_cast<int>(g.W),
            sh = static_cast<int>(g.sh), sw = static_cast<int>(g.sw), ph = static_cast<int>(g.ph),
            pw = static_cast<int>(g.pw), ipq = static_cast<int>(PQ);
  const int count = static_cast<int>((n1 - n0) * PQ);
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    const int nl = j / ipq, pq = j - nl * ipq, p = pq / Q, q = pq - p * Q;
    const int64_t plane_index = (n0 + nl) * g.C + c;
    const float d = to_float(dy[plane_index * PQ + pq]);
    const T* plane = x + plane_index * g.H * g.W;
#pragma unroll
    for (int r = 0; r < R; ++r) {  // R, S are constants when kR, kS are given: fully unrolled
      const int ih = p * sh - ph + r;
      const bool row_ok = ih >= 0 && ih < H;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int iw = q * sw - pw + s;
        if (row_ok && iw >= 0 && iw < W) acc[r * S + s] += d * to_float(plane[ih * W + iw]);
      }
    }
  }
  const int taps = R * S;
  for (int k = 0; k < taps; ++k) {
    const float v = block_sum(k < kTaps ? acc[k] : 0.0f, shared);
    if (threadIdx.x == 0) part[(grp * g.C + c) * taps + k] = v;
  }
}

/// Channels-last weight partials: part [G, C, R·S] over the output rows (n, p, q) of group
/// blockIdx.y, channel tile blockIdx.x (threads: kColTile channels × kColRows rows).
template <typename T, int kR, int kS>
__global__ void depthwise_weight_columns_kernel(float* part, const T* dy, const T* x, Geom g) {
  constexpr int kTaps = kR > 0 ? kR * kS : kMaxTaps;
  __shared__ float tile[kColRows][kColTile];
  const int R = kR > 0 ? kR : static_cast<int>(g.R), S = kS > 0 ? kS : static_cast<int>(g.S);
  const int64_t c = blockIdx.x * int64_t{kColTile} + threadIdx.x, G = gridDim.y;
  const int64_t rows = g.N * g.P * g.Q, r0 = rows * blockIdx.y / G,
                r1 = rows * (blockIdx.y + 1) / G;
  float acc[kTaps];
#pragma unroll
  for (int k = 0; k < kTaps; ++k) acc[k] = 0.0f;
  if (c < g.C)
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kColRows) {
      const int64_t q = row % g.Q, p = (row / g.Q) % g.P, n = row / (g.Q * g.P);
      const float d = to_float(dy[row * g.C + c]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t ih = p * g.sh - g.ph + r;
        const bool row_ok = ih >= 0 && ih < g.H;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const int64_t iw = q * g.sw - g.pw + s;
          if (row_ok && iw >= 0 && iw < g.W)
            acc[r * S + s] += d * to_float(x[((n * g.H + ih) * g.W + iw) * g.C + c]);
        }
      }
    }
  const int taps = R * S;
  for (int k = 0; k < taps; ++k) {
    tile[threadIdx.y][threadIdx.x] = k < kTaps ? acc[k] : 0.0f;
    __syncthreads();
    if (threadIdx.y == 0 && c < g.C) {
      float v = 0.0f;
      for (unsigned r = 0; r < kColRows; ++r) v += tile[r][threadIdx.x];
      part[(blockIdx.y * g.C + c) * taps + k] = v;
    }
    __syncthreads();
  }
}

Geom geom(const Conv2dShape& s) {
  return {s.N, s.C, s.H, s.W, s.P(), s.Q(), s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w};
}

/// Launches `kernel<T, kR, kS, I>` for the window (3×3 and 5×5 compiled with a fixed window) and
/// the index type (32-bit below 2^31 elements).
template <template <typename, int, int, typename> class K, typename T, typename... Args>
void launch_windowed(const CudaContext& ctx, const Conv2dShape& s, bool nhwc, int64_t n,
                     Args... args) {
  const unsigned grid = grid_for(ctx, n);
  const int R = static_cast<int>(s.R), S = static_cast<int>(s.S);
  auto go = [&]<typename I>() {
    const G<I> g(geom(s), nhwc);
    if (R == 3 && S == 3)
      K<T, 3, 3, I>::launch(grid, ctx.stream, args..., g, R, S, static_cast<I>(n));
    else if (R == 5 && S == 5)
      K<T, 5, 5, I>::launch(grid, ctx.stream, args..., g, R, S, static_cast<I>(n));
    else
      K<T, 0, 0, I>::launch(grid, ctx.stream, args..., g, R, S, static_cast<I>(n));
  };
  if (n < (int64_t{1} << 31))
    go.template operator()<int32_t>();
  else
    go.template operator()<int64_t>();
  ST_CUDA_LAUNCH_CHECK();
}

template <typename T, int kR, int kS, typename I>
struct ForwardKernel {
  static void launch(unsigned grid, cudaStream_t st, T* out, const T* x, const T* w, G<I> g, int R,
                     int S, I n) {
    depthwise_forward_kernel<T, kR, kS, I><<<grid, kImageBlock, 0, st>>>(out, x, w, g, R, S, n);
  }
};
template <typename T, int kR, int kS, typename I>
struct InputGradKernel {
  static void launch(unsigned grid, cudaStream_t st, T* dx, const T* dy, const T* w, G<I> g, int R,
                     int S, I n) {
    depthwise_input_grad_kernel<T, kR, kS, I><<<grid, kImageBlock, 0, st>>>(dx, dy, w, g, R, S, n);
  }
};

/// Calls the launcher for the window (3×3 and 5×5 compiled with a fixed window) with the grid
/// for n / 8 threads' worth of work (the vec8 kernels: 8 channels per thread).
template <typename F3, typename F5, typename F0>
void launch_vec8(const CudaContext& ctx, const Conv2dShape& s, int64_t n, F3 f3, F5 f5, F0 f0) {
  const unsigned grid = grid_for(ctx, n / 8);
  if (s.R == 3 && s.S == 3)
    f3(grid);
  else if (s.R == 5 && s.S == 5)
    f5(grid);
  else
    f0(grid);
  ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool is_depthwise(const Conv2dShape& s) {
  return s.groups > 1 && s.groups == s.C && s.K == s.C && s.R * s.S <= kMaxTaps;
}

void depthwise_forward(const CudaContext& ctx, Tensor out, Tensor inp, Tensor weight,
                       const Conv2dShape& s, bool nhwc) {
  if (vec8_ok(nhwc, s.C, {out.data, inp.data})) {
    const Geom g = geom(s);
    const int64_t n8 = out.numel() / 8;
    dispatch_float(inp.dtype, [&]<typename T>() {
      auto go = [&]<int kR, int kS>(unsigned grid) {
        depthwise_forward_vec8_kernel<T, kR, kS>
            <<<grid, kImageBlock, 0, ctx.stream>>>(out.as<T>(), inp.as<T>(), weight.as<T>(), g, n8);
      };
      launch_vec8(
          ctx, s, out.numel(), [&](unsigned grid) { go.template operator()<3, 3>(grid); },
          [&](unsigned grid) { go.template operator()<5, 5>(grid); },
          [&](unsigned grid) { go.template operator()<0, 0>(grid); });
    });
    return;
  }
  dispatch_float(inp.dtype, [&]<typename T>() {
    launch_windowed<ForwardKernel, T>(ctx, s, nhwc, out.numel(), out.as<T>(), inp.as<T>(),
                                      weight.as<T>());
  });
}

void depthwise_backward(const CudaContext& ctx, Tensor dinp, Tensor dweight, Tensor dout,
                        Tensor inp, Tensor weight, const Conv2dShape& s, bool nhwc) {
  const Geom g = geom(s);
  const int64_t taps = s.R * s.S;
  const int64_t G = nhwc ? column_groups(ctx, s.N * s.P() * s.Q(), s.C)
                         : image_groups(ctx, s.N, s.C, s.P() * s.Q());
  auto* part = static_cast<float*>(ctx.get_scratch(static_cast<size_t>(G * s.C * taps) * 4));
  dispatch_float(inp.dtype, [&]<typename T>() {
    const dim3 grid(static_cast<unsigned>(s.C), static_cast<unsigned>(G));
    const dim3 col_grid(ceil_div(static_cast<size_t>(s.C), kColTile), static_cast<unsigned>(G));
    const dim3 col_block(kColTile, kColRows);
    if (nhwc && s.R == 3 && s.S == 3)
      depthwise_weight_columns_kernel<T, 3, 3>
          <<<col_grid, col_block, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else if (nhwc && s.R == 5 && s.S == 5)
      depthwise_weight_columns_kernel<T, 5, 5>
          <<<col_grid, col_block, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else if (nhwc)
      depthwise_weight_columns_kernel<T, 0, 0>
          <<<col_grid, col_block, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else if (s.R == 3 && s.S == 3)
      depthwise_weight_partial_kernel<T, 3, 3>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else if (s.R == 5 && s.S == 5)
      depthwise_weight_partial_kernel<T, 5, 5>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    else
      depthwise_weight_partial_kernel<T, 0, 0>
          <<<grid, kImageBlock, 0, ctx.stream>>>(part, dout.as<T>(), inp.as<T>(), g);
    ST_CUDA_LAUNCH_CHECK();
    add_partial_sums(ctx.stream, dweight.as<T>(), part, G, s.C * taps);  // dweight [C, R·S]
    ST_CUDA_LAUNCH_CHECK();
    if (!dinp.empty() && vec8_ok(nhwc, s.C, {dinp.data, dout.data})) {
      const int64_t n8 = dinp.numel() / 8;
      auto go = [&]<int kR, int kS>(unsigned grid) {
        depthwise_input_grad_vec8_kernel<T, kR, kS><<<grid, kImageBlock, 0, ctx.stream>>>(
            dinp.as<T>(), dout.as<T>(), weight.as<T>(), g, n8);
      };
      launch_vec8(
          ctx, s, dinp.numel(), [&](unsigned grid) { go.template operator()<3, 3>(grid); },
          [&](unsigned grid) { go.template operator()<5, 5>(grid); },
          [&](unsigned grid) { go.template operator()<0, 0>(grid); });
    } else if (!dinp.empty())
      launch_windowed<InputGradKernel, T>(ctx, s, nhwc, dinp.numel(), dinp.as<T>(), dout.as<T>(),
                                          weight.as<T>());
  });
}

}  // namespace shardtrain::cuda
