// ImageOps: the compute ops of image classifiers (convolution, batch normalization, pooling,
// activations, squeeze-and-excitation's channel scaling, LSTM, classification loss), forward and
// backward side by side. A backend offers them through Backend::image_ops(); the CPU backend's
// are the fp32 reference (im2col + BLAS), the CUDA backend's use cuDNN.
//
// Conventions (those of backend.h, plus):
//  * Images are NCHW: [N, C, H, W] contiguous (N = images in the micro-batch). Convolution
//    weights are [K, C/groups, R, S] (PyTorch nn.Conv2d layout), K = output channels.
//  * Backward ops ACCUMULATE (+=) into parameter gradients and OVERWRITE activation gradients;
//    an empty dinp skips the input gradient (the first layer).
//  * Parameters (weights, biases, batch norm's γ and β) and activations are in the backend's
//    compute dtype; tensors noted "fp32" (batch-norm statistics, LSTM's saved gates, losses) are
//    fp32 and batch norm's per-channel sums are fp64 on every backend: a variance taken as
//    E[x²] − E[x]² from fp32 sums loses most of its digits when the mean is large against the
//    spread, which shifted deep gradients by percents in a parity test.
#pragma once

#include <cstdint>
#include <string>

#include "core/philox.h"
#include "core/tensor.h"

namespace shardtrain {

/// An element-wise activation (fused into batch norm and bias epilogues where a backend can).
enum class Activation {
  kNone,
  kRelu,     ///< max(x, 0)
  kRelu6,    ///< min(max(x, 0), 6) (Sandler et al., MobileNetV2, arXiv 1801.04381, §3.2)
  kSilu,     ///< x·σ(x) (Ramachandran et al., arXiv 1710.05941; EfficientNet's "swish")
  kSigmoid,  ///< σ(x) = 1/(1 + e^−x) (squeeze-and-excitation's gate)
};
const char* activation_name(Activation a);

/// A 2-D convolution's geometry (cross-correlation, as PyTorch): input [N, C, H, W], weight
/// [K, C/groups, R, S], output [N, K, P, Q] with P = (H + 2·pad_h − R)/stride_h + 1 and
/// Q = (W + 2·pad_w − S)/stride_w + 1. groups = C = K is a depthwise convolution.
struct Conv2dShape {
  int64_t N = 0, C = 0, H = 0, W = 0;
  int64_t K = 0, R = 1, S = 1;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int64_t groups = 1;
  int64_t P() const { return (H + 2 * pad_h - R) / stride_h + 1; }
  int64_t Q() const { return (W + 2 * pad_w - S) / stride_w + 1; }
};

/// A pooling window's geometry: input [N, C, H, W], output [N, C, P, Q] as Conv2dShape's with
/// kernel R×S. Average pooling divides by R·S (count_include_pad=True, PyTorch's default).
struct Pool2dShape {
  int64_t N = 0, C = 0, H = 0, W = 0;
  int64_t R = 1, S = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int64_t P() const { return (H + 2 * pad_h - R) / stride_h + 1; }
  int64_t Q() const { return (W + 2 * pad_w - S) / stride_w + 1; }
};

/// The image-model op set of a backend (see the file comment for conventions).
class ImageOps {
 public:
  virtual ~ImageOps() = default;

  // ---- image layout ------------------------------------------------------------------------
  // Images keep their logical shape [N, C, H, W] in every Tensor; their memory order is NCHW, or
  // channels-last (NHWC: element (n, c, h, w) at ((n·H + h)·W + w)·C + c) when channels_last().
  // Every op taking or producing an image uses that order; parameters keep PyTorch's layouts
  // (convolution weights [K, C/g, R, S]) and so do non-image tensors (LSTM sequences, [N, C]
  // scales, logits). Images with H = W = 1 are the same in both orders.

  /// Whether images are stored channels-last. The CPU reference is NCHW; the CUDA ops are
  /// channels-last for bf16/fp16 compute (cuDNN's tensor-core kernels and GEMM-shaped 1×1
  /// convolutions want it; transposing around each convolution cost 10–20% of a step) and NCHW
  /// for fp32 (the testing mode) unless set_channels_last() says otherwise.
  virtual bool channels_last() const { return false; }
  /// Chooses the layout (tests run both). Throws RuntimeFailure where a backend has only NCHW.
  virtual void set_channels_last(bool on);
  /// dst = src with src an NCHW image and dst in this ops' layout (a copy when that is NCHW);
  /// same shape and dtype, no aliasing.
  virtual void image_from_nchw(Tensor dst, Tensor src) = 0;
  /// dst (NCHW) = src (an image in this ops' layout); the inverse of image_from_nchw.
  virtual void image_to_nchw(Tensor dst, Tensor src) = 0;
  /// The model's input from decoded pixels: dst[n, c, h, w] = pixels[n, c, h, w]·scale[c] +
  /// shift[c], rounded once to dst's dtype, with dst [N, C, H, W] in this ops' layout (compute
  /// dtype), pixels [N, C, H, W] uint8 NCHW and affine fp32 [2, C] (scales, then shifts; for
  /// torchvision's Normalize after ToTensor, scale = 1/(255·std), shift = −mean/std).
  virtual void image_from_pixels(Tensor dst, Tensor pixels, Tensor affine) = 0;

  // ---- convolution --------------------------------------------------------------------------
  /// out [N,K,P,Q] = conv(inp [N,C,H,W], weight [K,C/g,R,S]) + bias [K] (may be empty),
  /// then `act`.
  virtual void conv2d_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              const Conv2dShape& s, Activation act = Activation::kNone) = 0;
  /// dinp [N,C,H,W] (overwrites; may be empty), dweight [K,C/g,R,S] +=, dbias [K] += (may be
  /// empty) from dout [N,K,P,Q] — the gradient with respect to the convolution's output
  /// (apply activation_backward first when forward fused an activation).
  virtual void conv2d_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                               Tensor weight, const Conv2dShape& s) = 0;

  // ---- batch normalization (Ioffe & Szegedy, arXiv 1502.03167, Algorithm 1 and 2) -----------
  // Per channel c over the N·H·W values x: training normalizes with the batch mean μ and the
  // biased variance σ², y = (x − μ)·γ/√(σ² + eps) + β, and updates the running statistics as
  // PyTorch: running ← (1 − momentum)·running + momentum·batch, with the unbiased variance.
  // Synchronized batch norm (--sync-batchnorm) splits the training forward and the backward at
  // their reductions so a caller can all-reduce the per-channel sums across ranks in between.

  /// Per-channel sums over inp [N,C,H,W]: sums [2, C] fp64 = (Σx, Σx²) (overwrites).
  virtual void batchnorm_statistics(Tensor sums, Tensor inp) = 0;
  /// Training forward from (possibly all-reduced) `sums` [2, C] over `count` values per channel:
  /// writes mean [C] and invstd [C] (fp32, for backward), updates running_mean/running_var [C]
  /// (fp32; skipped when empty), and out [N,C,H,W] = act(BN(inp)).
  virtual void batchnorm_forward_train(Tensor out, Tensor mean, Tensor invstd, Tensor running_mean,
                                       Tensor running_var, Tensor inp, Tensor weight, Tensor bias,
                                       Tensor sums, int64_t count, float eps, float momentum,
                                       Activation act = Activation::kNone) = 0;
  /// Evaluation forward with the running statistics: out = act((inp − rm)·γ/√(rv + eps) + β).
  virtual void batchnorm_forward_eval(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                      Tensor running_mean, Tensor running_var, float eps,
                                      Activation act = Activation::kNone) = 0;
  /// Backward, first half: dout [N,C,H,W] is ∂L/∂(act output); the activation's derivative is
  /// taken at the recomputed pre-activation (from inp, mean, invstd, weight, bias). Writes
  /// dsums [2, C] fp64 = (Σ dy, Σ dy·x̂) over this rank's values (dy: ∂L/∂(BN output)) and
  /// accumulates dweight [C] += Σ dy·x̂, dbias [C] += Σ dy (this rank's share: the data-parallel
  /// reduction of gradients sums them).
  virtual void batchnorm_backward_reduce(Tensor dsums, Tensor dweight, Tensor dbias, Tensor dout,
                                         Tensor inp, Tensor weight, Tensor bias, Tensor mean,
                                         Tensor invstd, Activation act = Activation::kNone) = 0;
  /// Backward, second half, from (possibly all-reduced) dsums over `count` values per channel:
  /// dinp [N,C,H,W] (overwrites) = γ·invstd·(dy − Σdy/count − x̂·Σdy·x̂/count).
  virtual void batchnorm_backward_input(Tensor dinp, Tensor dout, Tensor inp, Tensor weight,
                                        Tensor bias, Tensor mean, Tensor invstd, Tensor dsums,
                                        int64_t count, Activation act = Activation::kNone) = 0;

  // ---- activations ---------------------------------------------------------------------------
  /// out = act(inp), element-wise (out may alias inp).
  virtual void activation_forward(Tensor out, Tensor inp, Activation act) = 0;
  /// dinp = dout · act'(inp), where `inp` is the forward's input (dinp may alias dout).
  virtual void activation_backward(Tensor dinp, Tensor dout, Tensor inp, Activation act) = 0;

  // ---- pooling ---------------------------------------------------------------------------------
  /// Max pooling: out [N,C,P,Q]; padding never wins (as −∞).
  virtual void maxpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) = 0;
  /// dinp [N,C,H,W] (overwrites): each window's gradient goes to its first maximum (row-major).
  virtual void maxpool2d_backward(Tensor dinp, Tensor dout, Tensor inp, const Pool2dShape& s) = 0;
  /// Average pooling over the window (count_include_pad).
  virtual void avgpool2d_forward(Tensor out, Tensor inp, const Pool2dShape& s) = 0;
  virtual void avgpool2d_backward(Tensor dinp, Tensor dout, const Pool2dShape& s) = 0;
  /// Adaptive average pooling to out [N,C,P,Q] (PyTorch's AdaptiveAvgPool2d: output cell (i,j)
  /// averages rows ⌊i·H/P⌋ .. ⌈(i+1)·H/P⌉ − 1 and likewise columns). P = Q = 1 is global
  /// average pooling.
  virtual void adaptive_avgpool2d_forward(Tensor out, Tensor inp) = 0;
  virtual void adaptive_avgpool2d_backward(Tensor dinp, Tensor dout) = 0;

  // ---- squeeze-and-excitation's channel scaling (Hu et al., arXiv 1709.01507, eq. 4) ----------
  /// out [N,C,H,W] = inp [N,C,H,W] · scale [N,C] (broadcast over H, W).
  virtual void channel_scale_forward(Tensor out, Tensor inp, Tensor scale) = 0;
  /// dinp (overwrites) = dout · scale; dscale [N,C] (overwrites) = Σ_{H,W} dout · inp.
  virtual void channel_scale_backward(Tensor dinp, Tensor dscale, Tensor dout, Tensor inp,
                                      Tensor scale) = 0;

  /// Stochastic depth's per-sample scale (Huang et al., arXiv 1603.09382, §3; torchvision's
  /// StochasticDepth, mode "row"): scale [N, C] (compute dtype) = drop.factor(n) for every c —
  /// sample n is kept when Philox draw n of `drop` passes (probability 1 − p) and then scaled by
  /// 1/(1 − p), else 0. Generated where it is used (no host transfer), the same on every backend.
  virtual void sample_scale(Tensor scale, const Dropout& drop) = 0;

  // ---- LSTM (Hochreiter & Schmidhuber 1997; gates as PyTorch nn.LSTM: i, f, g, o) --------------
  // One layer, unidirectional, zero initial state, over inp [N, L, I] (batch-first, L steps):
  //   gates = x_t·W_ihᵀ + b_ih + h_{t−1}·W_hhᵀ + b_hh   ([N, 4H], chunks i f g o)
  //   c_t = σ(f)·c_{t−1} + σ(i)·tanh(g),  h_t = σ(o)·tanh(c_t)
  // out [N, L, H] holds every h_t. `saved` [L, N, 6H] fp32 keeps what backward needs (the four
  // activated gates, c_t and tanh(c_t)); weight_ih [4H, I], weight_hh [4H, H], biases [4H].
  virtual void lstm_forward(Tensor out, Tensor saved, Tensor inp, Tensor weight_ih,
                            Tensor weight_hh, Tensor bias_ih, Tensor bias_hh) = 0;
  /// Backpropagation through time: dinp [N,L,I] (overwrites; may be empty), parameter gradients
  /// (+=) from dout [N,L,H].
  virtual void lstm_backward(Tensor dinp, Tensor dweight_ih, Tensor dweight_hh, Tensor dbias_ih,
                             Tensor dbias_hh, Tensor dout, Tensor inp, Tensor out, Tensor saved,
                             Tensor weight_ih, Tensor weight_hh) = 0;

  // ---- layout
  // ------------------------------------------------------------------------------------
  /// out [A, C, B, D] = inp [A, B, C, D] (the two middle axes swapped; out must not alias inp),
  /// plain row-major tensors (not images): the LSTM's step-major and batch-major orders.
  virtual void swap_middle_axes(Tensor out, Tensor inp) = 0;
  /// A feature map's rows as a sequence: out [N, H, C·W] (row-major; feature c·W + w, PyTorch's
  /// x.permute(0, 2, 1, 3).flatten(2)) from the image inp [N, C, H, W] in this ops' layout.
  virtual void image_rows_as_sequence(Tensor out, Tensor inp);
  /// The inverse: the image dinp [N, C, H, W] (this ops' layout) from dout [N, H, C·W].
  virtual void sequence_as_image_rows(Tensor dinp, Tensor dout);

  // ---- classification loss ---------------------------------------------------------------------
  /// Softmax cross-entropy with label smoothing ε (Szegedy et al., arXiv 1512.00567, §7; as
  /// PyTorch's CrossEntropyLoss(label_smoothing=ε)): the target distribution is
  /// (1 − ε)·onehot + ε/K over K classes. logits [N, K] are overwritten with
  /// ∂L/∂logits · grad_scale = (softmax − target distribution) · grad_scale; losses [N] fp32
  /// receive each row's loss. targets [N] int32 in [0, K).
  virtual void classification_loss(Tensor losses, Tensor logits, Tensor targets,
                                   float label_smoothing, float grad_scale) = 0;
};

}  // namespace shardtrain
