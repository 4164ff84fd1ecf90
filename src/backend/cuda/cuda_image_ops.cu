// CudaImageOps: the CUDA backend's ImageOps (backend/image_ops.h). Convolution (cuDNN), batch
// norm and the LSTM live in their own files (cuda_image.h lists them); this file holds the class,
// the argument checks, and the small ops: activations, pooling, squeeze-and-excitation's channel
// scaling and the label-smoothed classification loss. Semantics match the CPU reference
// (backend/cpu/cpu_image_ops.cpp, cpu_conv.cpp) up to fp32 summation order; pooling backward
// gathers (each input element sums the windows that chose it) instead of scattering, so no
// kernel needs atomics and results are deterministic.
#include <algorithm>
#include <cfloat>
#include <string>

#include "backend/cuda/cuda_image.h"

namespace shardtrain::cuda {

namespace {

std::string dims_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : dims) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + "]";
}

}  // namespace

void expect_tensor(const char* op, const char* name, const Tensor& t, DType dt,
                   std::initializer_list<int64_t> dims) {
  require(!t.empty(), op, ": ", name, " is empty, expected a ", dtype_name(dt), " tensor of shape ",
          dims_str(dims));
  require(t.device == DeviceKind::kCUDA, op, ": ", name, " is on ", device_name(t.device),
          ", expected a CUDA tensor");
  require(t.dtype == dt, op, ": ", name, " ", t.shape_str(), " is ", dtype_name(t.dtype),
          ", expected ", dtype_name(dt));
  bool same = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) same = same && t.dim(i++) == d;
  require(same, op, ": ", name, " has shape ", t.shape_str(), ", expected ", dims_str(dims));
}

void expect_tensor_or_empty(const char* op, const char* name, const Tensor& t, DType dt,
                            std::initializer_list<int64_t> dims) {
  if (!t.empty()) expect_tensor(op, name, t, dt, dims);
}

void expect_nchw(const char* op, const char* name, const Tensor& t, DType dt) {
  require(!t.empty() && t.ndim == 4, op, ": ", name, " has shape ",
          t.empty() ? std::string("(empty)") : t.shape_str(), ", expected [N, C, H, W]");
  require(dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16, op, ": ", name, " is ",
          dtype_name(dt), ", expected fp32, bf16 or fp16");
  expect_tensor(op, name, t, dt, {t.dim(0), t.dim(1), t.dim(2), t.dim(3)});
}

unsigned grid_for(const CudaContext& ctx, int64_t n) {
  const int64_t blocks = (n + kImageBlock - 1) / kImageBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 32 * ctx.sm_count)));
}

int64_t image_groups(const CudaContext& ctx, int64_t N, int64_t C, int64_t HW) {
  const int64_t want = (4 * int64_t{ctx.sm_count} + C - 1) / C;
  return std::max<int64_t>(1, std::min({N, want, std::max<int64_t>(1, N * HW / 1024)}));
}

int64_t column_groups(const CudaContext& ctx, int64_t rows, int64_t C) {
  const int64_t tiles = (C + kColTile - 1) / kColTile;
  const int64_t want = (4 * int64_t{ctx.sm_count} + tiles - 1) / tiles;
  return std::max<int64_t>(1, std::min<int64_t>({want, rows / 64, 65535}));
}

namespace {

#define ST_GRID_STRIDE(i, n)                                                \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// ---- the model's input ------------------------------------------------------------------------

/// The model's input from uint8 NCHW pixels (ImageOps::image_from_pixels), one thread per pixel
/// position (n, h, w) and all C channels: the reads of each plane are coalesced, and so are the
/// channels-last writes (C consecutive elements per thread).
template <typename T>
__global__ void image_from_pixels_kernel(T* out, const uint8_t* px, const float* affine,
                                         ImageIndex ix, int64_t positions) {
  const int64_t HW = ix.H * ix.W;
  ST_GRID_STRIDE(p, positions) {
    const int64_t n = idiv(p, HW), hw = p - n * HW, h = idiv(hw, ix.W), w = hw - h * ix.W;
    for (int64_t c = 0; c < ix.C; ++c) {
      const float v =
          static_cast<float>(px[(n * ix.C + c) * HW + hw]) * affine[c] + affine[ix.C + c];
      out[ix.at(n, c, h, w)] = from_float<T>(v);
    }
  }
}

// ---- activations -------------------------------------------------------------------------------

template <typename T, Activation A>
__global__ void activation_forward_kernel(T* out, const T* x, int64_t n) {
  ST_GRID_STRIDE(i, n) out[i] = from_float<T>(act_forward<A>(to_float(x[i])));
}

template <typename T, Activation A>
__global__ void activation_backward_kernel(T* dx, const T* dy, const T* x, int64_t n) {
  ST_GRID_STRIDE(i, n) dx[i] = from_float<T>(to_float(dy[i]) * act_derivative<A>(to_float(x[i])));
}

// ---- pooling ----------------------------------------------------------------------------------
// One thread per output element (forward) or input element (gather backward); `nhwc` picks the
// images' memory order (ImageIndex).

struct PoolGeom {
  int64_t C, H, W, P, Q, R, S, sh, sw, ph, pw;
  bool nhwc;
  __device__ ImageIndex in() const { return {C, H, W, nhwc}; }
  __device__ ImageIndex out() const { return {C, P, Q, nhwc}; }
};
PoolGeom geom(const Pool2dShape& s, bool nhwc) {
  return {s.C, s.H, s.W, s.P(), s.Q(), s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, nhwc};
}

/// Flat index of the first maximum of window (p, q) of image n, channel c (row-major window
/// order), or −1; *best receives the maximum.
template <typename T>
__device__ __forceinline__ int64_t window_argmax(const T* x, const PoolGeom& g, int64_t n,
                                                 int64_t c, int64_t p, int64_t q, float* best) {
  const ImageIndex ix = g.in();
  float m = -FLT_MAX;
  int64_t arg = -1;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t ih = p * g.sh - g.ph + r;
    if (ih < 0 || ih >= g.H) continue;
    for (int64_t t = 0; t < g.S; ++t) {
      const int64_t iw = q * g.sw - g.pw + t;
      if (iw < 0 || iw >= g.W) continue;
      const int64_t k = ix.at(n, c, ih, iw);
      const float v = to_float(x[k]);
      if (arg < 0 || v > m) {
        m = v;
        arg = k;
      }
    }
  }
  *best = m;
  return arg;
}

/// The windows along one axis that contain input coordinate `i`: [lo, hi] (may be empty).
__device__ __forceinline__ void covering(int64_t i, int64_t pad, int64_t stride, int64_t win,
                                         int64_t outs, int64_t* lo, int64_t* hi) {
  const int64_t a = i + pad - win + 1;  // first window start ≤ i + pad whose end covers i
  *lo = a <= 0 ? 0 : (a + stride - 1) / stride;
  *hi = min((i + pad) / stride, outs - 1);
}

template <typename T>
__global__ void maxpool_forward_kernel(T* out, const T* x, PoolGeom g, int64_t n) {
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, p, q;
    g.out().coords(i, b, c, p, q);
    float m;
    window_argmax(x, g, b, c, p, q, &m);
    out[i] = from_float<T>(m);
  }
}

template <typename T>
__global__ void maxpool_backward_kernel(T* dx, const T* dy, const T* x, PoolGeom g, int64_t n) {
  const ImageIndex ox = g.out();
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, ih, iw;
    g.in().coords(i, b, c, ih, iw);
    int64_t p0, p1, q0, q1;
    covering(ih, g.ph, g.sh, g.R, g.P, &p0, &p1);
    covering(iw, g.pw, g.sw, g.S, g.Q, &q0, &q1);
    float acc = 0.0f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) {
        float m;
        if (window_argmax(x, g, b, c, p, q, &m) == i) acc += to_float(dy[ox.at(b, c, p, q)]);
      }
    dx[i] = from_float<T>(acc);
  }
}

/// Non-overlapping windows (stride = window, no padding; VGG's and the CNN's 2×2/2 pools): one
/// thread per window writes its whole window — dy at the first maximum, 0 elsewhere — so each
/// input is read once (the gather form re-reads every covering window). Inputs outside every
/// window (the last rows or columns when H or W is not a multiple of the window) are zeroed by
/// the caller.
template <typename T>
__global__ void maxpool_backward_tiled_kernel(T* dx, const T* dy, const T* x, PoolGeom g,
                                              int64_t n) {
  const ImageIndex ix = g.in();
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, p, q;
    g.out().coords(i, b, c, p, q);
    float m;
    const int64_t arg = window_argmax(x, g, b, c, p, q, &m);
    const T d = dy[i];
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t t = 0; t < g.S; ++t) {
        const int64_t k = ix.at(b, c, p * g.R + r, q * g.S + t);
        dx[k] = k == arg ? d : from_float<T>(0.0f);
      }
  }
}

/// Channels-last max pooling, 8 channels of one output pixel per thread (C % 8 == 0).
template <typename T>
__global__ void maxpool_forward_vec8_kernel(T* out, const T* x, PoolGeom g, int64_t n8) {
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8;
    int64_t b, c0, p, q;
    g.out().coords(i, b, c0, p, q);
    float m[8];
    bool any = false;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t ih = p * g.sh - g.ph + r;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t iw = q * g.sw - g.pw + s;
        if (iw < 0 || iw >= g.W) continue;
        float xv[8];
        load8(x + ((b * g.H + ih) * g.W + iw) * g.C + c0, xv);
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (!any || xv[k] > m[k]) m[k] = xv[k];
        any = true;
      }
    }
    if (!any)
#pragma unroll
      for (int k = 0; k < 8; ++k) m[k] = -FLT_MAX;
    store8(out + i, m);
  }
}

/// maxpool_backward_tiled_kernel on channels-last images, 8 channels per thread (C % 8 == 0).
template <typename T>
__global__ void maxpool_backward_tiled_vec8_kernel(T* dx, const T* dy, const T* x, PoolGeom g,
                                                   int64_t n8) {
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < n8;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = v * 8;
    int64_t b, c0, p, q;
    g.out().coords(i, b, c0, p, q);
    float m[8];
    int arg[8];
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        float xv[8];
        load8(x + ((b * g.H + p * g.R + r) * g.W + q * g.S + s) * g.C + c0, xv);
        const int pos = static_cast<int>(r * g.S + s);
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (pos == 0 || xv[k] > m[k]) m[k] = xv[k], arg[k] = pos;
      }
    float d[8];
    load8(dy + i, d);
    for (int64_t r = 0; r < g.R; ++r)
      for (int64_t s = 0; s < g.S; ++s) {
        const int pos = static_cast<int>(r * g.S + s);
        float o[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = arg[k] == pos ? d[k] : 0.0f;
        store8(dx + ((b * g.H + p * g.R + r) * g.W + q * g.S + s) * g.C + c0, o);
      }
  }
}

template <typename T>
__global__ void avgpool_forward_kernel(T* out, const T* x, PoolGeom g, int64_t n) {
  const ImageIndex ix = g.in();
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, p, q;
    g.out().coords(i, b, c, p, q);
    float acc = 0.0f;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t ih = p * g.sh - g.ph + r;
      if (ih < 0 || ih >= g.H) continue;
      for (int64_t t = 0; t < g.S; ++t) {
        const int64_t iw = q * g.sw - g.pw + t;
        if (iw >= 0 && iw < g.W) acc += to_float(x[ix.at(b, c, ih, iw)]);
      }
    }
    out[i] = from_float<T>(acc / static_cast<float>(g.R * g.S));
  }
}

template <typename T>
__global__ void avgpool_backward_kernel(T* dx, const T* dy, PoolGeom g, int64_t n) {
  const ImageIndex ox = g.out();
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, ih, iw;
    g.in().coords(i, b, c, ih, iw);
    int64_t p0, p1, q0, q1;
    covering(ih, g.ph, g.sh, g.R, g.P, &p0, &p1);
    covering(iw, g.pw, g.sw, g.S, g.Q, &q0, &q1);
    float acc = 0.0f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) acc += to_float(dy[ox.at(b, c, p, q)]);
    dx[i] = from_float<T>(acc / static_cast<float>(g.R * g.S));
  }
}

// PyTorch's adaptive regions: cell p covers [⌊p·H/P⌋, ⌈(p+1)·H/P⌉).
__device__ __forceinline__ int64_t adaptive_begin(int64_t p, int64_t H, int64_t P) {
  return p * H / P;
}
__device__ __forceinline__ int64_t adaptive_end(int64_t p, int64_t H, int64_t P) {
  return ((p + 1) * H + P - 1) / P;
}

template <typename T>
__global__ void adaptive_forward_kernel(T* out, const T* x, ImageIndex ix, ImageIndex ox,
                                        int64_t n) {
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, p, q;
    ox.coords(i, b, c, p, q);
    const int64_t h0 = adaptive_begin(p, ix.H, ox.H), h1 = adaptive_end(p, ix.H, ox.H);
    const int64_t w0 = adaptive_begin(q, ix.W, ox.W), w1 = adaptive_end(q, ix.W, ox.W);
    float acc = 0.0f;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) acc += to_float(x[ix.at(b, c, h, w)]);
    out[i] = from_float<T>(acc / static_cast<float>((h1 - h0) * (w1 - w0)));
  }
}

/// Global average pooling (P = Q = 1: EfficientNet's squeeze, the classifiers' final pool), NCHW:
/// one warp per (n, c) plane, so a warp's loads are contiguous.
template <typename T>
__global__ void global_avgpool_forward_kernel(T* out, const T* x, int64_t NC, int64_t HW) {
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= NC) return;
  const T* plane = x + warp * HW;
  float acc = 0.0f;
  for (int64_t j = lane; j < HW; j += 32) acc += to_float(plane[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[warp] = from_float<T>(acc / static_cast<float>(HW));
}

/// Per-image channel sums of a channels-last image [N, HW, C], each image's pixels split into G
/// groups: part [G, N, C] fp32, grid (⌈C/32⌉ channel tiles, N, G), threads kColTile × kColRows.
/// Sums `a` (global average pooling), or with kScaleGrad Σ a·x and writes dx = a·scale[n, c] on
/// the way (channel_scale's backward, a = dout; dx may alias a: each element is read before it
/// is written, by the same thread).
template <typename T, bool kScaleGrad>
__global__ void image_channel_partial_kernel(float* part, T* dx, const T* a, const T* x,
                                             const T* scale, int64_t C, int64_t HW) {
  __shared__ float tile[kColRows][kColTile];
  const int64_t c = blockIdx.x * int64_t{kColTile} + threadIdx.x, n = blockIdx.y;
  const int64_t N = gridDim.y, G = gridDim.z;
  const int64_t h0 = HW * blockIdx.z / G, h1 = HW * (blockIdx.z + 1) / G;
  float acc = 0.0f;
  if (c < C) {
    const float s = kScaleGrad ? to_float(scale[n * C + c]) : 0.0f;
    for (int64_t j = h0 + threadIdx.y; j < h1; j += kColRows) {
      const int64_t k = (n * HW + j) * C + c;
      const float v = to_float(a[k]);
      if constexpr (kScaleGrad) {
        acc += v * to_float(x[k]);
        dx[k] = from_float<T>(v * s);
      } else {
        acc += v;
      }
    }
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  for (unsigned r = 1; r < kColRows; ++r) acc += tile[r][threadIdx.x];
  part[(blockIdx.z * N + n) * C + c] = acc;
}

/// out [N·C] = factor · Σ_g part [G, N·C], in group order.
template <typename T>
__global__ void image_channel_finish_kernel(T* out, const float* part, int64_t G, int64_t NC,
                                            float factor) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= NC) return;
  float acc = 0.0f;
  for (int64_t g = 0; g < G; ++g) acc += part[g * NC + i];
  out[i] = from_float<T>(acc * factor);
}

/// dx = dy [N, C] / HW broadcast over the pixels (global average pooling's backward).
template <typename T>
__global__ void global_avgpool_backward_kernel(T* dx, const T* dy, ImageIndex ix, int64_t n) {
  const float inv = 1.0f / static_cast<float>(ix.H * ix.W);
  ST_GRID_STRIDE(i, n)
  dx[i] = from_float<T>(to_float(dy[ix.image(i) * ix.C + ix.channel(i)]) * inv);
}

template <typename T>
__global__ void adaptive_backward_kernel(T* dx, const T* dy, ImageIndex ix, ImageIndex ox,
                                         int64_t n) {
  ST_GRID_STRIDE(i, n) {
    int64_t b, c, h, w;
    ix.coords(i, b, c, h, w);
    float acc = 0.0f;
    for (int64_t p = 0; p < ox.H; ++p) {
      const int64_t h0 = adaptive_begin(p, ix.H, ox.H), h1 = adaptive_end(p, ix.H, ox.H);
      if (h < h0 || h >= h1) continue;
      for (int64_t q = 0; q < ox.W; ++q) {
        const int64_t w0 = adaptive_begin(q, ix.W, ox.W), w1 = adaptive_end(q, ix.W, ox.W);
        if (w < w0 || w >= w1) continue;
        acc += to_float(dy[ox.at(b, c, p, q)]) / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
    dx[i] = from_float<T>(acc);
  }
}

// ---- channel scaling ----------------------------------------------------------------------------

template <typename T>
__global__ void channel_scale_forward_kernel(T* out, const T* x, const T* scale, ImageIndex ix,
                                             int64_t n) {
  ST_GRID_STRIDE(i, n) {
    out[i] = from_float<T>(to_float(x[i]) * to_float(scale[ix.image(i) * ix.C + ix.channel(i)]));
  }
}

/// One warp per (n, c) plane: dscale = Σ dout·x, dinp = dout·scale (read before written: dinp
/// may alias dout).
template <typename T>
__global__ void channel_scale_backward_kernel(T* dx, T* dscale, const T* dy, const T* x,
                                              const T* scale, int64_t NC, int64_t HW) {
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= NC) return;
  const float s = to_float(scale[warp]);
  float acc = 0.0f;
  for (int64_t j = lane; j < HW; j += 32) {
    const int64_t i = warp * HW + j;
    const float d = to_float(dy[i]);
    acc += d * to_float(x[i]);
    dx[i] = from_float<T>(d * s);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) dscale[warp] = from_float<T>(acc);
}

/// scale [N, C] = drop.factor(n) (ImageOps::sample_scale).
template <typename T>
__global__ void sample_scale_kernel(T* scale, Dropout mask, int64_t C, int64_t n) {
  const Dropout drop = mask.with_device_seed();
  const uint32_t thresh = drop.threshold();
  ST_GRID_STRIDE(i, n) {
    const uint64_t sample = static_cast<uint64_t>(i / C);
    scale[i] = from_float<T>(drop.keep(sample, thresh) ? drop.scale() : 0.0f);
  }
}

// ---- layout -------------------------------------------------------------------------------------

/// out [A, C, B, D] = x [A, B, C, D].
template <typename T>
__global__ void swap_middle_axes_kernel(T* out, const T* x, int64_t B, int64_t C, int64_t D,
                                        int64_t n) {
  ST_GRID_STRIDE(i, n) {
    const int64_t d = i % D, c = (i / D) % C, b = (i / (C * D)) % B, a = i / (B * C * D);
    out[((a * C + c) * B + b) * D + d] = x[i];
  }
}

// ---- classification loss ------------------------------------------------------------------------

/// One block per row: loss = −(1−ε)·log p_target − (ε/K)·Σ log p_k, logits ← (p − target)·scale.
/// A target outside [0, K) gives a NaN loss (and a zero gradient row), which the step's loss
/// check reports.
template <typename T>
__global__ void classification_loss_kernel(float* losses, T* logits, const int32_t* targets,
                                           int64_t K, float eps, float grad_scale) {
  __shared__ float shared[32];
  T* row = logits + blockIdx.x * K;
  const int32_t tg = targets[blockIdx.x];
  float m = -FLT_MAX;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) m = fmaxf(m, to_float(row[k]));
    // the row's maximum: within each warp by shuffles, then across the block's warps
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float warp_max[32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = -FLT_MAX;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) m = fmaxf(m, warp_max[w]);
  float se = 0.0f, sl = 0.0f;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const float z = to_float(row[k]);
    se += __expf(z - m);
    sl += z;
  }
  se = block_sum(se, shared);
  sl = block_sum(sl, shared);
  const float lse = m + logf(se), off = eps / static_cast<float>(K);
  const bool valid = tg >= 0 && tg < K;
  if (threadIdx.x == 0) {
    losses[blockIdx.x] =
        valid ? -(1.0f - eps) * (to_float(row[tg]) - lse) - off * (sl - static_cast<float>(K) * lse)
              : __int_as_float(0x7fc00000);
  }
  __syncthreads();  // row[tg] is read above before it is overwritten below
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const float p = __expf(to_float(row[k]) - lse);
    const float target = (k == tg ? 1.0f - eps : 0.0f) + off;
    row[k] = from_float<T>(valid ? (p - target) * grad_scale : 0.0f);
  }
}

// ---- the class ------------------------------------------------------------------------------

class CudaImageOps final : public ImageOps {
 public:
  CudaImageOps(const CudaContext& ctx, Backend& backend)
      : ctx_(ctx),
        backend_(backend),
        conv_(make_conv_runner(ctx, backend)),
        nhwc_(backend.compute_dtype() != DType::kF32) {}

  bool channels_last() const override { return nhwc_; }
  void set_channels_last(bool on) override { nhwc_ = on; }
  void image_from_nchw(Tensor dst, Tensor src) override {
    relayout("cuda image_from_nchw", dst, src, true);
  }
  void image_to_nchw(Tensor dst, Tensor src) override {
    relayout("cuda image_to_nchw", dst, src, false);
  }
  void image_from_pixels(Tensor dst, Tensor pixels, Tensor affine) override {
    const char* op = "cuda image_from_pixels";
    require(pixels.ndim == 4, op, ": pixels has shape ", pixels.shape_str(),
            ", expected [N, C, H, W]");
    expect_tensor(op, "pixels", pixels, DType::kU8,
                  {pixels.dim(0), pixels.dim(1), pixels.dim(2), pixels.dim(3)});
    const int64_t N = pixels.dim(0), C = pixels.dim(1), H = pixels.dim(2), W = pixels.dim(3);
    expect_nchw(op, "dst", dst, dst.dtype);
    expect_tensor(op, "dst", dst, dst.dtype, {N, C, H, W});
    expect_tensor(op, "affine", affine, DType::kF32, {2, C});
    const ImageIndex ix{C, H, W, nhwc_};
    dispatch_float(dst.dtype, [&]<typename T>() {
      image_from_pixels_kernel<T><<<grid_for(ctx_, N * H * W), kImageBlock, 0, ctx_.stream>>>(
          dst.as<T>(), static_cast<const uint8_t*>(pixels.data), affine.as<float>(), ix, N * H * W);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void image_rows_as_sequence(Tensor out, Tensor inp) override {
    if (!nhwc_) return ImageOps::image_rows_as_sequence(out, inp);
    rows_relayout("cuda image_rows_as_sequence", inp, out, true);
  }
  void sequence_as_image_rows(Tensor dinp, Tensor dout) override {
    if (!nhwc_) return ImageOps::sequence_as_image_rows(dinp, dout);
    rows_relayout("cuda sequence_as_image_rows", dinp, dout, false);
  }

  void conv2d_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const Conv2dShape& s,
                      Activation act) override {
    const char* op = "cuda conv2d_forward";
    check_conv(op, s, inp, weight);
    expect_tensor_or_empty(op, "bias", bias, inp.dtype, {s.K});
    expect_tensor(op, "out", out, inp.dtype, {s.N, s.K, s.P(), s.Q()});
    conv_->forward(out, inp, weight, bias, s, act, nhwc_);
  }
  void conv2d_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                       Tensor weight, const Conv2dShape& s) override {
    const char* op = "cuda conv2d_backward";
    check_conv(op, s, inp, weight);
    expect_tensor(op, "dout", dout, inp.dtype, {s.N, s.K, s.P(), s.Q()});
    expect_tensor(op, "dweight", dweight, inp.dtype, {s.K, s.C / s.groups, s.R, s.S});
    expect_tensor_or_empty(op, "dbias", dbias, inp.dtype, {s.K});
    expect_tensor_or_empty(op, "dinp", dinp, inp.dtype, {s.N, s.C, s.H, s.W});
    conv_->backward(dinp, dweight, dbias, dout, inp, weight, s, nhwc_);
  }

  void batchnorm_statistics(Tensor sums, Tensor inp) override {
    cuda::batchnorm_statistics(ctx_, sums, inp, nhwc_);
  }
  void batchnorm_forward_train(Tensor out, Tensor mean, Tensor invstd, Tensor running_mean,
                               Tensor running_var, Tensor inp, Tensor weight, Tensor bias,
                               Tensor sums, int64_t count, float eps, float momentum,
                               Activation act) override {
    cuda::batchnorm_forward_train(ctx_, out, mean, invstd, running_mean, running_var, inp, weight,
                                  bias, sums, count, eps, momentum, act, nhwc_);
  }
  void batchnorm_forward_eval(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              Tensor running_mean, Tensor running_var, float eps,
                              Activation act) override {
    cuda::batchnorm_forward_eval(ctx_, out, inp, weight, bias, running_mean, running_var, eps, act,
                                 nhwc_);
  }
  void batchnorm_backward_reduce(Tensor dsums, Tensor dweight, Tensor dbias, Tensor dout,
                                 Tensor inp, Tensor weight, Tensor bias, Tensor mean, Tensor invstd,
                                 Activation act) override {
    cuda::batchnorm_backward_reduce(ctx_, dsums, dweight, dbias, dout, inp, weight, bias, mean,
                                    invstd, act, nhwc_);
  }
  void batchnorm_backward_input(Tensor dinp, Tensor dout, Tensor inp, Tensor weight, Tensor bias,
                                Tensor mean, Tensor invstd, Tensor dsums, int64_t count,
                                Activation act) override {
    cuda::batchnorm_backward_input(ctx_, dinp, dout, inp, weight, bias, mean, invstd, dsums, count,
                                   act, nhwc_);
  }

  void activation_forward(Tensor out, Tensor inp, Activation act) override {
    expect_same("cuda activation_forward", "out", out, inp);
    const int64_t n = inp.numel();
    dispatch_float(inp.dtype, [&]<typename T>() {
      dispatch_activation(act, [&]<Activation A>() {
        activation_forward_kernel<T, A>
            <<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(out.as<T>(), inp.as<T>(), n);
      });
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void activation_backward(Tensor dinp, Tensor dout, Tensor inp, Activation act) override {
    const char* op = "cuda activation_backward";
    expect_same(op, "dout", dout, inp);
    expect_same(op, "dinp", dinp, inp);
    const int64_t n = inp.numel();
    dispatch_float(inp.dtype, [&]<typename T>() {
      dispatch_activation(act, [&]<Activation A>() {
        activation_backward_kernel<T, A><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), dout.as<T>(), inp.as<T>(), n);
      });
    });
    ST_CUDA_LAUNCH_CHECK();
  }

  void maxpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) override {
    check_pool("cuda maxpool2d_forward", out, "out", inp, "inp", s);
    const int64_t n = out.numel();
    const bool vec = vec8_ok(nhwc_, s.C, {out.data, inp.data});
    dispatch_float(inp.dtype, [&]<typename T>() {
      if (vec)
        maxpool_forward_vec8_kernel<T><<<grid_for(ctx_, n / 8), kImageBlock, 0, ctx_.stream>>>(
            out.as<T>(), inp.as<T>(), geom(s, nhwc_), n / 8);
      else
        maxpool_forward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
            out.as<T>(), inp.as<T>(), geom(s, nhwc_), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void maxpool2d_backward(Tensor dinp, Tensor dout, Tensor inp, const Pool2dShape& s) override {
    const char* op = "cuda maxpool2d_backward";
    check_pool(op, dout, "dout", inp, "inp", s);
    expect_same(op, "dinp", dinp, inp);
    const int64_t n = dinp.numel();
    const bool tiled = s.stride_h == s.R && s.stride_w == s.S && s.pad_h == 0 && s.pad_w == 0;
    if (tiled && (s.P() * s.R != s.H || s.Q() * s.S != s.W))
      ST_CUDA_CHECK(cudaMemsetAsync(dinp.data, 0, dinp.bytes(), ctx_.stream));
    dispatch_float(inp.dtype, [&]<typename T>() {
      if (tiled && vec8_ok(nhwc_, s.C, {dinp.data, dout.data, inp.data})) {
        const int64_t n8 = dout.numel() / 8;
        maxpool_backward_tiled_vec8_kernel<T><<<grid_for(ctx_, n8), kImageBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), dout.as<T>(), inp.as<T>(), geom(s, nhwc_), n8);
      } else if (tiled) {
        const int64_t windows = dout.numel();
        maxpool_backward_tiled_kernel<T><<<grid_for(ctx_, windows), kImageBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), dout.as<T>(), inp.as<T>(), geom(s, nhwc_), windows);
      } else {
        maxpool_backward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), dout.as<T>(), inp.as<T>(), geom(s, nhwc_), n);
      }
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void avgpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) override {
    check_pool("cuda avgpool2d_forward", out, "out", inp, "inp", s);
    const int64_t n = out.numel();
    dispatch_float(inp.dtype, [&]<typename T>() {
      avgpool_forward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          out.as<T>(), inp.as<T>(), geom(s, nhwc_), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void avgpool2d_backward(Tensor dinp, Tensor dout, const Pool2dShape& s) override {
    check_pool("cuda avgpool2d_backward", dout, "dout", dinp, "dinp", s);
    const int64_t n = dinp.numel();
    dispatch_float(dinp.dtype, [&]<typename T>() {
      avgpool_backward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          dinp.as<T>(), dout.as<T>(), geom(s, nhwc_), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void adaptive_avgpool2d_forward(Tensor out, Tensor inp) override {
    const char* op = "cuda adaptive_avgpool2d_forward";
    check_adaptive(op, out, "out", inp, "inp");
    const int64_t n = out.numel();
    dispatch_float(inp.dtype, [&]<typename T>() {
      const int64_t HW = inp.dim(2) * inp.dim(3);
      if (out.dim(2) == 1 && out.dim(3) == 1 && nhwc_) {
        image_channel_sums<T, false>(out, nullptr, inp, {}, {}, 1.0f / static_cast<float>(HW));
        return;
      }
      if (out.dim(2) == 1 && out.dim(3) == 1) {
        const size_t threads = static_cast<size_t>(n) * 32;
        global_avgpool_forward_kernel<T>
            <<<ceil_div(threads, kImageBlock), kImageBlock, 0, ctx_.stream>>>(out.as<T>(),
                                                                              inp.as<T>(), n, HW);
        return;
      }
      adaptive_forward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          out.as<T>(), inp.as<T>(), index(inp), index(out), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void adaptive_avgpool2d_backward(Tensor dinp, Tensor dout) override {
    const char* op = "cuda adaptive_avgpool2d_backward";
    check_adaptive(op, dout, "dout", dinp, "dinp");
    const int64_t n = dinp.numel();
    dispatch_float(dinp.dtype, [&]<typename T>() {
      if (dout.dim(2) == 1 && dout.dim(3) == 1) {
        global_avgpool_backward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
            dinp.as<T>(), dout.as<T>(), index(dinp), n);
        return;
      }
      adaptive_backward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          dinp.as<T>(), dout.as<T>(), index(dinp), index(dout), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }

  void channel_scale_forward(Tensor out, Tensor inp, Tensor scale) override {
    const char* op = "cuda channel_scale_forward";
    expect_nchw(op, "inp", inp, inp.dtype);
    expect_same(op, "out", out, inp);
    expect_tensor(op, "scale", scale, inp.dtype, {inp.dim(0), inp.dim(1)});
    const int64_t n = inp.numel(), HW = inp.dim(2) * inp.dim(3);
    dispatch_float(inp.dtype, [&]<typename T>() {
      channel_scale_forward_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          out.as<T>(), inp.as<T>(), scale.as<T>(), index(inp), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void sample_scale(Tensor scale, const Dropout& drop) override {
    const int64_t n = scale.numel();
    require(scale.ndim == 2, "cuda sample_scale: scale must be [N, C]");
    dispatch_float(scale.dtype, [&]<typename T>() {
      sample_scale_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          scale.as<T>(), drop, scale.dim(1), n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
  void channel_scale_backward(Tensor dinp, Tensor dscale, Tensor dout, Tensor inp,
                              Tensor scale) override {
    const char* op = "cuda channel_scale_backward";
    expect_nchw(op, "inp", inp, inp.dtype);
    expect_same(op, "dout", dout, inp);
    expect_same(op, "dinp", dinp, inp);
    expect_tensor(op, "scale", scale, inp.dtype, {inp.dim(0), inp.dim(1)});
    expect_tensor(op, "dscale", dscale, inp.dtype, {inp.dim(0), inp.dim(1)});
    const int64_t NC = inp.dim(0) * inp.dim(1), HW = inp.dim(2) * inp.dim(3);
    dispatch_float(inp.dtype, [&]<typename T>() {
      if (nhwc_)
        image_channel_sums<T, true>(dscale, dinp.as<T>(), dout, inp, scale, 1.0f);
      else
        channel_scale_backward_kernel<T>
            <<<ceil_div(static_cast<size_t>(NC) * 32, kImageBlock), kImageBlock, 0, ctx_.stream>>>(
                dinp.as<T>(), dscale.as<T>(), dout.as<T>(), inp.as<T>(), scale.as<T>(), NC, HW);
    });
    ST_CUDA_LAUNCH_CHECK();
  }

  void lstm_forward(Tensor out, Tensor saved, Tensor inp, Tensor weight_ih, Tensor weight_hh,
                    Tensor bias_ih, Tensor bias_hh) override {
    cuda::lstm_forward(ctx_, backend_, out, saved, inp, weight_ih, weight_hh, bias_ih, bias_hh);
  }
  void lstm_backward(Tensor dinp, Tensor dweight_ih, Tensor dweight_hh, Tensor dbias_ih,
                     Tensor dbias_hh, Tensor dout, Tensor inp, Tensor out, Tensor saved,
                     Tensor weight_ih, Tensor weight_hh) override {
    cuda::lstm_backward(ctx_, backend_, dinp, dweight_ih, dweight_hh, dbias_ih, dbias_hh, dout, inp,
                        out, saved, weight_ih, weight_hh);
  }

  void swap_middle_axes(Tensor out, Tensor inp) override {
    const char* op = "cuda swap_middle_axes";
    expect_nchw(op, "inp", inp, inp.dtype);
    const int64_t A = inp.dim(0), B = inp.dim(1), C = inp.dim(2), D = inp.dim(3);
    expect_tensor(op, "out", out, inp.dtype, {A, C, B, D});
    require(out.data != inp.data, op, ": out must not alias inp");
    const int64_t n = inp.numel();
    dispatch_float(inp.dtype, [&]<typename T>() {
      swap_middle_axes_kernel<T><<<grid_for(ctx_, n), kImageBlock, 0, ctx_.stream>>>(
          out.as<T>(), inp.as<T>(), B, C, D, n);
    });
    ST_CUDA_LAUNCH_CHECK();
  }

  void classification_loss(Tensor losses, Tensor logits, Tensor targets, float label_smoothing,
                           float grad_scale) override {
    const char* op = "cuda classification_loss";
    require(!logits.empty() && logits.ndim == 2, op, ": logits has shape ",
            logits.empty() ? std::string("(empty)") : logits.shape_str(), ", expected [N, K]");
    const int64_t N = logits.dim(0), K = logits.dim(1);
    expect_tensor(op, "logits", logits, logits.dtype, {N, K});
    expect_tensor(op, "losses", losses, DType::kF32, {N});
    expect_tensor(op, "targets", targets, DType::kI32, {N});
    require(label_smoothing >= 0.0f && label_smoothing <= 1.0f, op,
            ": label_smoothing must be in [0, 1]");
    dispatch_float(logits.dtype, [&]<typename T>() {
      classification_loss_kernel<T>
          <<<static_cast<unsigned>(N), K <= 128 ? 64 : 256, 0, ctx_.stream>>>(
              losses.as<float>(), logits.as<T>(), targets.as<int32_t>(), K, label_smoothing,
              grad_scale);
    });
    ST_CUDA_LAUNCH_CHECK();
  }

 private:
  /// out [N, C] = factor · the per-image channel sums of the channels-last image `a` (kScaleGrad:
  /// of a·x, writing dx = a·scale too): image_channel_partial_kernel over enough pixel groups to
  /// fill the GPU (≥ 32 pixels each), then image_channel_finish_kernel.
  template <typename T, bool kScaleGrad>
  void image_channel_sums(Tensor out, T* dx, Tensor a, Tensor x, Tensor scale, float factor) {
    const int64_t N = a.dim(0), C = a.dim(1), HW = a.dim(2) * a.dim(3);
    const int64_t tiles = (C + kColTile - 1) / kColTile;
    const int64_t want = (4 * int64_t{ctx_.sm_count} + tiles * N - 1) / (tiles * N);
    const int64_t G = std::max<int64_t>(1, std::min<int64_t>({want, HW / 32, 65535}));
    auto* part = static_cast<float*>(ctx_.get_scratch(static_cast<size_t>(G * N * C) * 4));
    image_channel_partial_kernel<T, kScaleGrad>
        <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(N), static_cast<unsigned>(G)),
           dim3(kColTile, kColRows), 0, ctx_.stream>>>(
            part, dx, a.as<T>(), x.empty() ? nullptr : x.as<T>(),
            scale.empty() ? nullptr : scale.as<T>(), C, HW);
    ST_CUDA_LAUNCH_CHECK();
    image_channel_finish_kernel<T>
        <<<ceil_div(static_cast<size_t>(N * C), kImageBlock), kImageBlock, 0, ctx_.stream>>>(
            out.as<T>(), part, G, N * C, factor);
    ST_CUDA_LAUNCH_CHECK();
  }

  /// Between a channels-last image [N, C, H, W] and the sequence [N, H, C·W]: per (n, h) row a
  /// [W, C] ↔ [C, W] transpose (`to_sequence`: image → sequence).
  void rows_relayout(const char* op, Tensor image, Tensor seq, bool to_sequence) {
    expect_nchw(op, "image", image, image.dtype);
    const int64_t N = image.dim(0), C = image.dim(1), H = image.dim(2), W = image.dim(3);
    expect_tensor(op, "sequence", seq, image.dtype, {N, H, C * W});
    if (to_sequence)
      batched_transpose(ctx_, seq, image, N * H, W, C);
    else
      batched_transpose(ctx_, image, seq, N * H, C, W);
  }

  /// The memory order of image `t` [N, C, H, W] in these ops.
  ImageIndex index(const Tensor& t) const { return {t.dim(1), t.dim(2), t.dim(3), nhwc_}; }
  /// dst = src between NCHW and this ops' layout (`to_native`: from NCHW).
  void relayout(const char* op, Tensor dst, Tensor src, bool to_native) {
    expect_nchw(op, "src", src, src.dtype);
    expect_same(op, "dst", dst, src);
    require(dst.data != src.data, op, ": dst must not alias src");
    const int64_t N = src.dim(0), C = src.dim(1), HW = src.dim(2) * src.dim(3);
    if (!nhwc_ || HW == 1 || C == 1) {
      ST_CUDA_CHECK(
          cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, ctx_.stream));
    } else if (to_native) {
      batched_transpose(ctx_, dst, src, N, C, HW);
    } else {
      batched_transpose(ctx_, dst, src, N, HW, C);
    }
  }

  static void check_conv(const char* op, const Conv2dShape& s, const Tensor& inp,
                         const Tensor& weight) {
    require(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.K > 0 && s.R > 0 && s.S > 0 &&
                s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 && s.groups > 0 &&
                s.C % s.groups == 0 && s.K % s.groups == 0 && s.H + 2 * s.pad_h >= s.R &&
                s.W + 2 * s.pad_w >= s.S,
            op, ": invalid geometry N=", s.N, " C=", s.C, " H=", s.H, " W=", s.W, " K=", s.K,
            " R=", s.R, " S=", s.S, " groups=", s.groups);
    expect_nchw(op, "inp", inp, inp.dtype);
    expect_tensor(op, "inp", inp, inp.dtype, {s.N, s.C, s.H, s.W});
    expect_tensor(op, "weight", weight, inp.dtype, {s.K, s.C / s.groups, s.R, s.S});
  }
  /// `t` has `ref`'s shape and dtype on the GPU.
  static void expect_same(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
    require(!ref.empty() && ref.ndim >= 1, op, ": the input is empty");
    require(!t.empty() && t.ndim == ref.ndim && t.numel() == ref.numel(), op, ": ", name,
            " has shape ", t.empty() ? std::string("(empty)") : t.shape_str(), ", expected ",
            ref.shape_str());
    require(
        t.dtype == ref.dtype && t.device == DeviceKind::kCUDA && ref.device == DeviceKind::kCUDA,
        op, ": ", name, " must be a CUDA ", dtype_name(ref.dtype), " tensor");
  }
  static void check_pool(const char* op, const Tensor& y, const char* y_name, const Tensor& x,
                         const char* x_name, const Pool2dShape& s) {
    require(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.R > 0 && s.S > 0 && s.stride_h > 0 &&
                s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 && s.H + 2 * s.pad_h >= s.R &&
                s.W + 2 * s.pad_w >= s.S,
            op, ": invalid geometry N=", s.N, " C=", s.C, " H=", s.H, " W=", s.W, " window ", s.R,
            "x", s.S);
    expect_nchw(op, x_name, x, x.dtype);
    expect_tensor(op, x_name, x, x.dtype, {s.N, s.C, s.H, s.W});
    expect_tensor(op, y_name, y, x.dtype, {s.N, s.C, s.P(), s.Q()});
  }
  static void check_adaptive(const char* op, const Tensor& y, const char* y_name, const Tensor& x,
                             const char* x_name) {
    expect_nchw(op, x_name, x, x.dtype);
    expect_nchw(op, y_name, y, x.dtype);
    require(y.dim(0) == x.dim(0) && y.dim(1) == x.dim(1), op, ": ", y_name, " has shape ",
            y.shape_str(), ", expected [N, C, P, Q] for ", x_name, " ", x.shape_str());
  }

  const CudaContext& ctx_;
  Backend& backend_;
  std::unique_ptr<ConvRunner> conv_;
  bool nhwc_;  ///< images channels-last (ImageOps::channels_last)
};

}  // namespace

std::unique_ptr<ImageOps> make_cuda_image_ops(const CudaContext& ctx, Backend& backend) {
  return std::make_unique<CudaImageOps>(ctx, backend);
}

}  // namespace shardtrain::cuda
