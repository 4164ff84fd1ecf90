// One LSTM layer on the GPU (ImageOps::lstm_forward/backward; gates i f g o as PyTorch nn.LSTM):
// the input projections of all L steps in one cuBLASLt GEMM, then per step one GEMM for
// h_{t−1}·W_hhᵀ and one fused kernel for the gate non-linearities and the cell update.
// Backward (backpropagation through time) runs the steps in reverse with one fused kernel and one
// GEMM (dh_{t−1} = dG_t·W_hh) per step, then the weight gradients of all steps in three GEMMs.
// Written on cuBLASLt rather than cuDNN's RNN API: the layer keeps PyTorch's weight layout and the
// ImageOps `saved` contract (no weight-space packing per step), and its GEMMs are the backend's
// tuned ones.
#include "backend/cuda/cuda_image.h"
#include "backend/cuda/cuda_ops.h"

namespace shardtrain::cuda {
namespace {

Tensor rows(const Tensor& t, int64_t first, int64_t count, int64_t width) {
  return Tensor(
      static_cast<char*>(t.data) + static_cast<size_t>(first * width) * dtype_size(t.dtype),
      t.dtype, t.device, {count, width});
}

/// Step t of the forward for every (n, j): the gates from the input projection G [N, L, 4H]
/// (b_ih included), the recurrent projection R [N, 4H] (b_hh included; t = 0: b_hh alone), the
/// cell update, saved [t, n, 6H] = (i, f, g, o, c, tanh c), h into out [N, L, H] and hs [N, H].
template <typename T>
__global__ void lstm_step_kernel(float* saved, T* out, T* hs, const T* G, const T* R,
                                 const T* bias_hh, int64_t t, int64_t N, int64_t L, int64_t H) {
  const int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H, G4 = 4 * H;
  const T* g = G + (n * L + t) * G4;
  auto pre = [&](int64_t k) {
    return to_float(g[k]) + (t > 0 ? to_float(R[n * G4 + k]) : to_float(bias_hh[k]));
  };
  const float ig = sigmoidf(pre(j)), fg = sigmoidf(pre(H + j)), gg = tanhf(pre(2 * H + j)),
              og = sigmoidf(pre(3 * H + j));
  const float c_prev = t > 0 ? saved[((t - 1) * N + n) * 6 * H + 4 * H + j] : 0.0f;
  const float c = fg * c_prev + ig * gg, tc = tanhf(c);
  float* s = saved + (t * N + n) * 6 * H;
  s[j] = ig;
  s[H + j] = fg;
  s[2 * H + j] = gg;
  s[3 * H + j] = og;
  s[4 * H + j] = c;
  s[5 * H + j] = tc;
  const T h = from_float<T>(og * tc);
  out[(n * L + t) * H + j] = h;
  hs[n * H + j] = h;
}

/// Step t of the backward: dh = dout[n, t] + dh_rec (t < L−1), dc = dc_carry + dh·o·(1 − tanh²c);
/// writes the gate gradients dG [t, n, 4H] and carries dc·f.
template <typename T>
__global__ void lstm_step_backward_kernel(T* dG, float* dc_carry, const float* saved, const T* dout,
                                          const T* dh_rec, int64_t t, int64_t N, int64_t L,
                                          int64_t H) {
  const int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  const float* s = saved + (t * N + n) * 6 * H;
  const float ig = s[j], fg = s[H + j], gg = s[2 * H + j], og = s[3 * H + j], tc = s[5 * H + j];
  const float c_prev = t > 0 ? saved[((t - 1) * N + n) * 6 * H + 4 * H + j] : 0.0f;
  const float dh = to_float(dout[(n * L + t) * H + j]) + (t < L - 1 ? to_float(dh_rec[idx]) : 0.0f);
  const float dc = (t < L - 1 ? dc_carry[idx] : 0.0f) + dh * og * (1.0f - tc * tc);
  T* g = dG + (t * N + n) * 4 * H;
  g[j] = from_float<T>(dc * gg * ig * (1.0f - ig));
  g[H + j] = from_float<T>(dc * c_prev * fg * (1.0f - fg));
  g[2 * H + j] = from_float<T>(dc * ig * (1.0f - gg * gg));
  g[3 * H + j] = from_float<T>(dh * tc * og * (1.0f - og));
  dc_carry[idx] = dc * fg;
}

/// dst [B, A, D] = src [A, B, D] with the first two axes swapped.
template <typename T>
__global__ void swap_axes_kernel(T* dst, const T* src, int64_t A, int64_t B, int64_t D) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < A * B * D;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = i % D, b = (i / D) % B, a = i / (B * D);
    dst[(b * A + a) * D + d] = src[i];
  }
}

/// db [cols] += Σ_r m [rows, cols] (one thread per column, rows in order).
template <typename T>
__global__ void column_sum_kernel(T* db, const T* m, int64_t rows, int64_t cols) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (j >= cols) return;
  float acc = 0.0f;
  for (int64_t r = 0; r < rows; ++r) acc += to_float(m[r * cols + j]);
  db[j] = from_float<T>(to_float(db[j]) + acc);
}

struct Dims {
  int64_t N, L, I, H;
};

Dims check_lstm(const char* op, const Tensor& inp, const Tensor& weight_ih,
                const Tensor& weight_hh) {
  require(!inp.empty() && inp.ndim == 3, op, ": inp has shape ",
          inp.empty() ? std::string("(empty)") : inp.shape_str(), ", expected [N, L, I]");
  require(!weight_ih.empty() && weight_ih.ndim == 2 && weight_ih.dim(0) % 4 == 0, op,
          ": weight_ih must be [4H, I]");
  const Dims d{inp.dim(0), inp.dim(1), inp.dim(2), weight_ih.dim(0) / 4};
  expect_tensor(op, "inp", inp, inp.dtype, {d.N, d.L, d.I});
  expect_tensor(op, "weight_ih", weight_ih, inp.dtype, {4 * d.H, d.I});
  expect_tensor(op, "weight_hh", weight_hh, inp.dtype, {4 * d.H, d.H});
  return d;
}

}  // namespace

void lstm_forward(const CudaContext& ctx, Backend& backend, Tensor out, Tensor saved, Tensor inp,
                  Tensor weight_ih, Tensor weight_hh, Tensor bias_ih, Tensor bias_hh) {
  const char* op = "cuda lstm_forward";
  const auto [N, L, I, H] = check_lstm(op, inp, weight_ih, weight_hh);
  const DType dt = inp.dtype;
  expect_tensor(op, "bias_ih", bias_ih, dt, {4 * H});
  expect_tensor(op, "bias_hh", bias_hh, dt, {4 * H});
  expect_tensor(op, "out", out, dt, {N, L, H});
  expect_tensor(op, "saved", saved, DType::kF32, {L, N, 6 * H});
  Temp G(backend, dt, {N * L, 4 * H}), R(backend, dt, {N, 4 * H}), hs(backend, dt, {N, H});
  matmul_forward(ctx, *G, inp.reshape({N * L, I}), weight_ih, bias_ih, Epilogue::kNone, {});
  for (int64_t t = 0; t < L; ++t) {
    if (t > 0) matmul_forward(ctx, *R, *hs, weight_hh, bias_hh, Epilogue::kNone, {});
    dispatch_float(dt, [&]<typename T>() {
      lstm_step_kernel<T>
          <<<ceil_div(static_cast<size_t>(N * H), kImageBlock), kImageBlock, 0, ctx.stream>>>(
              saved.as<float>(), out.as<T>(), (*hs).as<T>(), (*G).as<T>(), (*R).as<T>(),
              bias_hh.as<T>(), t, N, L, H);
    });
    ST_CUDA_LAUNCH_CHECK();
  }
}

void lstm_backward(const CudaContext& ctx, Backend& backend, Tensor dinp, Tensor dweight_ih,
                   Tensor dweight_hh, Tensor dbias_ih, Tensor dbias_hh, Tensor dout, Tensor inp,
                   Tensor out, Tensor saved, Tensor weight_ih, Tensor weight_hh) {
  const char* op = "cuda lstm_backward";
  const auto [N, L, I, H] = check_lstm(op, inp, weight_ih, weight_hh);
  const DType dt = inp.dtype;
  const int64_t G4 = 4 * H;
  expect_tensor(op, "dweight_ih", dweight_ih, dt, {G4, I});
  expect_tensor(op, "dweight_hh", dweight_hh, dt, {G4, H});
  expect_tensor(op, "dbias_ih", dbias_ih, dt, {G4});
  expect_tensor(op, "dbias_hh", dbias_hh, dt, {G4});
  expect_tensor(op, "dout", dout, dt, {N, L, H});
  expect_tensor(op, "out", out, dt, {N, L, H});
  expect_tensor(op, "saved", saved, DType::kF32, {L, N, 6 * H});
  expect_tensor_or_empty(op, "dinp", dinp, dt, {N, L, I});
  Temp dG(backend, dt, {L * N, G4}), dh(backend, dt, {N, H}), dc(backend, DType::kF32, {N, H});
  const unsigned blocks = ceil_div(static_cast<size_t>(N * H), kImageBlock);
  for (int64_t t = L - 1; t >= 0; --t) {
    dispatch_float(dt, [&]<typename T>() {
      lstm_step_backward_kernel<T><<<blocks, kImageBlock, 0, ctx.stream>>>(
          (*dG).as<T>(), (*dc).as<float>(), saved.as<float>(), dout.as<T>(), (*dh).as<T>(), t, N, L,
          H);
    });
    ST_CUDA_LAUNCH_CHECK();
    // dh_{t−1} = dG_t [N, 4H] · W_hh [4H, H]
    if (t > 0) matmul_backward(ctx, *dh, {}, {}, rows(*dG, t * N, N, G4), *dh, weight_hh, {});
  }
  const int64_t total = L * N * G4;
  const unsigned grid = grid_for(ctx, total);
  dispatch_float(dt, [&]<typename T>() {
    // db_hh += Σ over every step and image (the same sum as db_ih's).
    column_sum_kernel<T>
        <<<ceil_div(static_cast<size_t>(G4), kImageBlock), kImageBlock, 0, ctx.stream>>>(
            dbias_hh.as<T>(), (*dG).as<T>(), L * N, G4);
  });
  ST_CUDA_LAUNCH_CHECK();
  if (L > 1) {
    // dW_hh += Σ_{t ≥ 1} dG_tᵀ · h_{t−1}: the h of steps 0..L−2, step-major like dG.
    Temp hs(backend, dt, {L * N, H});
    dispatch_float(dt, [&]<typename T>() {
      swap_axes_kernel<T><<<grid_for(ctx, N * L * H), kImageBlock, 0, ctx.stream>>>(
          (*hs).as<T>(), out.as<T>(), N, L, H);
    });
    ST_CUDA_LAUNCH_CHECK();
    matmul_backward(ctx, {}, dweight_hh, {}, rows(*dG, N, (L - 1) * N, G4),
                    rows(*hs, 0, (L - 1) * N, H), weight_hh, {});
  }
  // The input side in batch-first order: dW_ih += dGᵀ·inp, db_ih += Σ dG, dinp = dG·W_ih.
  Temp dGb(backend, dt, {N * L, G4});
  dispatch_float(dt, [&]<typename T>() {
    swap_axes_kernel<T>
        <<<grid, kImageBlock, 0, ctx.stream>>>((*dGb).as<T>(), (*dG).as<T>(), L, N, G4);
  });
  ST_CUDA_LAUNCH_CHECK();
  matmul_backward(ctx, dinp.empty() ? Tensor() : dinp.reshape({N * L, I}), dweight_ih, dbias_ih,
                  *dGb, inp.reshape({N * L, I}), weight_ih, {});
}

}  // namespace shardtrain::cuda
