// Backend: device memory and the compute ops of GPT-2 training, forward and backward side by
// side (llm.c's habit). One interface, two implementations: backend/cpu (fp32 reference,
// OpenMP + BLAS) and backend/cuda (bf16 mixed precision, fused kernels).
//
// Conventions, for every op:
//  * B = batch (micro-batch), T = sequence length, C = channels (n_embd), NH = heads,
//    V = vocabulary, N = B*T rows. Tensors are contiguous row-major.
//  * Linear weights are [OC, IC] (PyTorch nn.Linear layout); y = x·Wᵀ + b.
//  * Backward ops ACCUMULATE (+=) into parameter gradients (so micro-batches accumulate).
//    Activation gradients are OVERWRITTEN, except layernorm_backward, which accumulates into
//    dinp (the residual stream), as noted on each op.
//  * Ops are enqueued in order on the backend's compute stream; synchronize() waits for them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/host_transfer.h"
#include "backend/image_ops.h"
#include "core/philox.h"
#include "core/tensor.h"

namespace shardtrain {

/// Elements per scale of Backend::quantize_int8.
inline constexpr int64_t kQuantBlock = 256;

/// Extra work fused into a matmul's output.
enum class Epilogue { kNone, kGelu };

/// What attention_forward saves for attention_backward: the softmax probabilities
/// [B, NH, T, T] (CPU reference) or the per-row log-sum-exp [B, NH, T] (flash attention).
struct AttentionSaved {
  Tensor probs;  ///< [B, NH, T, T] in attention_probs_dtype(), or empty
  Tensor lse;    ///< [B, NH, T] fp32, or empty
};

/// Timestamps in stream order, for timing the phases of a step without synchronizing inside it
/// (DeepSpeed's wall_clock_breakdown). On CUDA a mark is an event recorded on the compute stream,
/// so it is taken when the work enqueued before it has run; this default uses the host clock,
/// which is the same thing on a backend whose ops run synchronously (CPU).
class StreamClock {
 public:
  virtual ~StreamClock() = default;
  /// Takes a timestamp after the work enqueued so far.
  virtual void mark() { host_.push_back(std::chrono::steady_clock::now()); }
  /// Seconds between consecutive marks (marks − 1 values, in order); then forgets the marks.
  /// Waits for the marks to be taken.
  virtual std::vector<double> intervals() {
    std::vector<double> out;
    for (size_t i = 1; i < host_.size(); ++i)
      out.push_back(std::chrono::duration<double>(host_[i] - host_[i - 1]).count());
    host_.clear();
    return out;
  }

 private:
  std::vector<std::chrono::steady_clock::time_point> host_;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  /// Human-readable device description, e.g. "cpu (2 threads)" or "NVIDIA H100 80GB HBM3".
  virtual std::string description() const = 0;
  /// The device's total memory in bytes (a GPU's), or 0 where there is no such limit (CPU).
  virtual size_t device_memory_bytes() const { return 0; }
  /// The dtype activations and compute parameters use on this backend (fp32 on CPU).
  virtual DType compute_dtype() const = 0;
  /// The stream every op is enqueued on (a cudaStream_t on CUDA; nullptr on CPU). GPU
  /// communicators must be given it (Communicator::set_compute_stream) so that collectives start
  /// after the kernels that produce their inputs.
  virtual void* native_stream() const { return nullptr; }
  /// A clock whose marks follow the work on the compute stream (see StreamClock).
  virtual std::unique_ptr<StreamClock> make_stream_clock() {
    return std::make_unique<StreamClock>();
  }

  // ---- memory ------------------------------------------------------------------------------
  /// Allocates `bytes` of device memory (64-byte aligned, zero-filled). Throws RuntimeFailure
  /// naming the request and what is held when out of memory.
  virtual void* allocate(size_t bytes) = 0;
  /// As allocate() without the zero fill, for temporaries an op overwrites before reading
  /// (saves a memset per call on backends that fill; the default fills anyway).
  virtual void* allocate_uninitialized(size_t bytes) { return allocate(bytes); }
  virtual void deallocate(void* ptr) noexcept = 0;
  /// Copies between host and this device (or within it); blocking.
  virtual void copy_to_host(void* dst_host, const void* src_device, size_t bytes) = 0;
  virtual void copy_from_host(void* dst_device, const void* src_host, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  /// A host → device copy enqueued after the work already enqueued, without waiting for it:
  /// `src_host` must stay unchanged until the stream has run the copy (synchronize(), or any
  /// blocking read after it). Asynchronous only from pinned memory (allocate_pinned); the default
  /// is the blocking copy.
  virtual void copy_from_host_async(void* dst_device, const void* src_host, size_t bytes) {
    copy_from_host(dst_device, src_host, bytes);
  }
  virtual void fill_zero(Tensor t) = 0;
  virtual void synchronize() {}
  /// Bytes currently allocated and the peak since start (or since reset_peak_memory()).
  virtual size_t allocated_bytes() const = 0;
  virtual size_t peak_allocated_bytes() const = 0;
  virtual void reset_peak_memory() = 0;
  /// Bytes obtained from the device (a caching allocator's cached blocks included) and their
  /// peak; equal to the allocated bytes for backends without a cache.
  virtual size_t reserved_bytes() const { return allocated_bytes(); }
  virtual size_t peak_reserved_bytes() const { return peak_allocated_bytes(); }

  // ---- device graphs (CUDA Graphs) ----------------------------------------------------------
  /// Recorded device work, replayed with one launch instead of one per op: the host cost of a
  /// step of small kernels (NVIDIA, CUDA Programming Guide, "CUDA Graphs").
  class Graph {
   public:
    virtual ~Graph() = default;
    /// Enqueues the recorded work on the compute stream, with the arguments and addresses it was
    /// captured with.
    virtual void replay() = 0;
    /// False once memory the graph uses has been freed (e.g. an activation buffer regrown by a
    /// larger batch): the caller must capture again instead of replaying.
    virtual bool valid() const = 0;
  };
  /// Records, without running it, the device work `body` enqueues. The body must only enqueue
  /// work on the compute stream: no blocking copy, synchronize() or host read; every kernel
  /// argument (pointers, scalars) is frozen into the graph, so what changes between replays must
  /// be read from device memory. Temporaries the body frees stay reserved for the graph while it
  /// lives (reserved; a replay counts them as allocated while it runs, at the capture's peak);
  /// blocks live at the end are pinned (see Graph::valid).
  /// Returns null where the backend has no graphs (CPU). Throws RuntimeFailure, naming the CUDA
  /// error, when the body did something that cannot be captured; the stream stays usable.
  virtual std::unique_ptr<Graph> capture(const std::function<void()>& /*body*/) { return nullptr; }

  // ---- host memory for transfers (offload) ---------------------------------------------------
  /// Allocates `bytes` of host memory that copy streams move at full speed: page-locked (pinned)
  /// on CUDA, plain 4096-byte aligned memory on CPU. Not zeroed. Throws RuntimeFailure naming the
  /// request, what this process already holds and what the host has available when it cannot be
  /// had (with the fixes: lower the request, raise the container's memory limit).
  virtual void* allocate_pinned(size_t bytes);
  /// Frees what allocate_pinned(bytes) returned.
  virtual void free_pinned(void* ptr, size_t bytes) noexcept;
  /// Pinned bytes held now (allocate_pinned minus free_pinned).
  size_t pinned_bytes() const { return pinned_bytes_; }
  /// A new stream for host ↔ device copies beside the compute stream (see CopyStream).
  virtual std::unique_ptr<CopyStream> make_copy_stream() { return std::make_unique<CopyStream>(); }
  /// A timeline of device work on the compute stream and the copy streams this backend made
  /// (see DeviceTimeline).
  virtual std::unique_ptr<DeviceTimeline> make_device_timeline() {
    return std::make_unique<DeviceTimeline>();
  }

  // ---- dtype conversion ----------------------------------------------------------------------
  /// dst = src element-wise with dtype conversion (round-to-nearest-even for bf16/fp16).
  virtual void convert(Tensor dst, Tensor src) = 0;

  // ---- embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:] ----------------------------------
  /// out [B,T,C]; tokens [B,T] int32 (device); wte [V,C]; wpe [maxT,C]. With an active
  /// `dropout` (GPT-2's embd_pdrop), out = dropout(wte[tok] + wpe), the mask of element
  /// (b·T+t)·C+c (see Dropout in core/philox.h) fused into the same pass.
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                                 const Dropout& dropout = {}) = 0;
  /// dwte [V,C] += scatter of dout by token; dwpe [maxT,C] += Σ_b dout[b,t,:]. With an active
  /// `dropout` (the forward's), dout is multiplied by the regenerated mask/(1-p) as it is read.
  /// Either of dwte and dwpe may be empty to skip its part (the tied-embedding hand-off,
  /// LayerHooks::take_tied_embedding_grad: wpe's part locally, wte's over all ranks' rows).
  virtual void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                                  const Dropout& dropout = {}) = 0;

  // ---- layernorm (Ba et al., arXiv 1607.06450, eq. 4; eps = 1e-5) -----------------------------
  /// out [N,C] = (inp - mean) * rstd * weight + bias; saves mean [N], rstd [N] (fp32).
  virtual void layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight,
                                 Tensor bias) = 0;
  /// dinp [N,C] += ∂L/∂inp (accumulates: the residual stream); dweight, dbias [C] +=.
  virtual void layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                  Tensor inp, Tensor weight, Tensor mean, Tensor rstd) = 0;

  // ---- linear layers -----------------------------------------------------------------------
  /// out [N,OC] = inp [N,IC] · weight[OC,IC]ᵀ + bias[OC] (bias may be empty). With
  /// Epilogue::kGelu, `pre_gelu` [N,OC] receives the pre-activation and out = gelu(pre_gelu).
  /// Without an epilogue `out` may also be [N,OCp], OCp = padded_columns(OC) > OC: rows then have
  /// stride OCp and columns [OC, OCp) receive zeros.
  virtual void matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                              Epilogue epilogue = Epilogue::kNone, Tensor pre_gelu = {}) = 0;
  /// dinp [N,IC] = dout · weight (overwrites; may be empty to skip); dweight [OC,IC] += doutᵀ·inp
  /// (may be empty to skip: a zero-bubble pipeline's input-gradient pass); dbias [OC] += Σ_rows
  /// dout (may be empty). When `dinp_gelu_input` [N,IC] is given, dinp is
  /// further multiplied by gelu'(dinp_gelu_input) — the backward of a GELU that produced `inp`
  /// (fused into the matmul's epilogue on GPU). `dout` may be [N,OCp] (as matmul_forward's
  /// `out`; then dbias must be empty): columns [OC, OCp) are ignored and must hold finite values.
  virtual void matmul_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                               Tensor weight, Tensor dinp_gelu_input = {}) = 0;
  /// The row stride (elements) to give an [N, OC] matmul output with OC columns, such as the LM
  /// head's logits (OC = vocabulary, 50257 for GPT-2): OC itself, or OC rounded up where the
  /// backend's GEMMs are much faster on aligned shapes (CUDA: a multiple of 64, 50304).
  virtual int64_t padded_columns(int64_t oc) const { return oc; }

  // ---- GELU, tanh approximation (Hendrycks & Gimpel, arXiv 1606.08415, §2) -------------------
  virtual void gelu_forward(Tensor out, Tensor inp) = 0;
  /// dinp = dout * gelu'(inp) (overwrites).
  virtual void gelu_backward(Tensor dinp, Tensor inp, Tensor dout) = 0;

  // ---- residual ------------------------------------------------------------------------------
  /// out = a + b (element-wise, same shape; out may alias a or b). With an active `dropout_b`
  /// (GPT-2's resid_pdrop), out = a + dropout(b): b's element i is kept with the mask of index i.
  virtual void add(Tensor out, Tensor a, Tensor b, const Dropout& dropout_b = {}) = 0;
  /// dst = src ∘ mask / (1-p) (element-wise, same shape, any length; dst may alias src): the
  /// backward of the dropout `dropout` applied to a tensor of src's shape (src = ∂L/∂output).
  virtual void dropout_backward(Tensor dst, Tensor src, const Dropout& dropout) = 0;

  // ---- causal self-attention (Vaswani et al., arXiv 1706.03762, eq. 1) ----------------------
  /// qkv [B,T,3C] laid out as [q | k | v], each C = NH*hs; out [B,T,C] (heads concatenated).
  /// `saved` receives what backward needs (see AttentionSaved; sized by attention_saved_shape).
  /// With an active `dropout` (GPT-2's attn_pdrop) the probabilities P [B,NH,T,T] are dropped
  /// before ·V: out = (P∘M/(1-p))·V, M the mask of element ((b·NH+h)·T+tq)·T+tk; saved
  /// probabilities stay P (before dropout) and backward regenerates M.
  virtual void attention_forward(Tensor out, AttentionSaved saved, Tensor qkv, int num_heads,
                                 const Dropout& dropout = {}) = 0;
  /// dqkv [B,T,3C] (overwrites) from dout [B,T,C]; `dropout` as given to the forward. With
  /// Pd = P∘M/(1-p): dV = Pdᵀ·dO, dP = (dO·Vᵀ)∘M/(1-p), dS = P∘(dP − rowsum(dO∘O)).
  virtual void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                  AttentionSaved saved, int num_heads,
                                  const Dropout& dropout = {}) = 0;
  /// Whether attention over heads of `head_size` channels saves probabilities [B,NH,T,T]
  /// (true: materialized kernels) or log-sum-exp [B,NH,T] in fp32 (false: fused kernels that
  /// recompute the probabilities in backward). Fixed for the backend's lifetime.
  virtual bool attention_saves_probs(int head_size) const = 0;
  /// The dtype of saved probabilities (fp32 on CPU; the compute dtype on GPU).
  virtual DType attention_probs_dtype() const { return DType::kF32; }

  // ---- fused softmax + cross-entropy over the vocabulary ------------------------------------
  /// logits [N,Vp]: rows of stride Vp ≥ vocab whose first `vocab` columns are the scores (see
  /// padded_columns); overwritten with ∂L/∂logits = (softmax - onehot(target)) * grad_scale in
  /// those columns, the others untouched. targets [N] int32; losses [N] fp32 receives
  /// -log softmax[target] per row. Rows whose target is < 0 are ignored (loss 0, gradient 0).
  virtual void softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets, float grad_scale,
                                     int64_t vocab) = 0;
  /// Forward only (for evaluation): losses [N] from logits [N,Vp] as above; logits unchanged.
  virtual void cross_entropy_forward(Tensor losses, Tensor logits, Tensor targets,
                                     int64_t vocab) = 0;

  // ---- reductions and optimizer ----------------------------------------------------------------
  /// Σ x² over the tensor, accumulated in double, deterministic. Blocking.
  virtual double sum_squares(Tensor x) = 0;
  /// Σ x (fp32 tensor) in double. Blocking.
  virtual double sum(Tensor x) = 0;
  /// x *= s.
  virtual void scale(Tensor x, float s) = 0;

  // ---- blockwise int8 quantization (ZeRO++'s qgZ, arXiv 2306.10209 §3.3) -----------------------
  /// Symmetric int8 per block of kQuantBlock elements of `x` [n] (fp32, bf16 or fp16): scales[b]
  /// = max |x| over block b / 127 (fp32 [ceil(n / kQuantBlock)]; 0 for an all-zero block) and
  /// q[i] = round(x[i] / scales[b]) in [−127, 127], stored as int8 in `q` [n] (DType::kU8 bytes).
  virtual void quantize_int8(Tensor q, Tensor scales, Tensor x) = 0;
  /// out[i] += q[i] · scales[i / kQuantBlock] (out fp32, bf16 or fp16; q and scales as
  /// quantize_int8 writes them).
  virtual void dequantize_add_int8(Tensor out, Tensor q, Tensor scales) = 0;

  /// AdamW step on one contiguous range (Loshchilov & Hutter, arXiv 1711.05101, Algorithm 2):
  ///   g = grad * grad_scale; m = β1 m + (1-β1) g; v = β2 v + (1-β2) g²;
  ///   p -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p )
  /// with bc1 = 1 - β1^t, bc2 = 1 - β2^t. master, m, v fp32 [n]; grad in the grad dtype [n].
  /// When `params_out` is non-empty, the updated master weights are also written to it in its
  /// dtype (the bf16 compute copy on GPU).
  struct AdamWArgs {
    float lr, beta1, beta2, eps, weight_decay, grad_scale;
    float bias_correction1, bias_correction2;
  };
  virtual void adamw(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
                     const AdamWArgs& args) = 0;
  /// A run of an adamw_runs() call: its elements [begin, begin + count), with or without weight
  /// decay (the layout's matrices decay; biases and layernorm parameters do not).
  struct AdamWRun {
    int64_t begin = 0;
    int64_t count = 0;
    bool decay = false;
  };
  /// adamw() over consecutive runs of one range (master, grad, m, v, params_out as for adamw(),
  /// [n] with n the runs' total; runs in order from 0): run r's elements take weight_decay =
  /// runs[r].decay ? args.weight_decay : 0. The same arithmetic per element as one adamw() per
  /// run, which is what this default does; CUDA updates up to kAdamWRunsPerLaunch runs in one
  /// kernel (a GPT-2 layer has 8 runs, most of them a few thousand elements).
  virtual void adamw_runs(Tensor master, Tensor grad, Tensor m, Tensor v, Tensor params_out,
                          const std::vector<AdamWRun>& runs, AdamWArgs args) {
    const float wd = args.weight_decay;
    for (const AdamWRun& r : runs) {
      args.weight_decay = r.decay ? wd : 0.0f;
      const auto part = [&](const Tensor& t) {
        return t.empty() ? Tensor() : t.slice1d(r.begin, r.count);
      };
      adamw(part(master), part(grad), part(m), part(v), part(params_out), args);
    }
  }

  /// SGD with momentum (and Nesterov momentum) on one contiguous range, exactly
  /// torch.optim.SGD with dampening 0 (PyTorch docs, torch.optim.SGD; Nesterov momentum as
  /// Sutskever et al., "On the importance of initialization and momentum in deep learning",
  /// ICML 2013, in PyTorch's formulation):
  ///   g = grad * grad_scale + weight_decay * p          (coupled L2, as PyTorch)
  ///   buf = first_step ? g : momentum * buf + g          (when momentum != 0)
  ///   d = nesterov ? g + momentum * buf : buf            (d = g when momentum == 0)
  ///   p -= lr * d
  /// master fp32 [n]; grad [n] in the grad dtype (fp32, bf16 or fp16); momentum_buf fp32 [n]
  /// (the optimizer's exp_avg slot), ignored and may be empty when momentum == 0. When
  /// `params_out` is non-empty, the updated master weights are also written to it in its dtype.
  struct SgdArgs {
    float lr, momentum, weight_decay, grad_scale;
    bool nesterov;    ///< requires momentum > 0
    bool first_step;  ///< the buffer is initialized to g instead of updated (PyTorch)
  };
  virtual void sgd(Tensor master, Tensor grad, Tensor momentum_buf, Tensor params_out,
                   const SgdArgs& args) = 0;

  // ---- image models ------------------------------------------------------------------------
  /// The backend's convolution / batch norm / pooling / LSTM ops (backend/image_ops.h), or null
  /// where it has none yet.
  virtual ImageOps* image_ops() { return nullptr; }

 protected:
  size_t pinned_bytes_ = 0;  ///< kept by allocate_pinned / free_pinned
};

/// The CPU backend (fp32, OpenMP threads, BLAS matmuls).
std::unique_ptr<Backend> make_cpu_backend();

/// The CUDA backend on device `device_index`, computing in `compute_dtype` (kBF16 by default; kF16
/// for fp16 mixed precision; kF32 for testing). Throws RuntimeFailure when no CUDA GPU or driver
/// is available or shardtrain was built without CUDA.
std::unique_ptr<Backend> make_cuda_backend(int device_index, DType compute_dtype = DType::kBF16);

/// True when shardtrain was built with CUDA and a GPU is visible.
bool cuda_available();

/// One line of `shardtrain env` (DeepSpeed's ds_report): a library or device and what this build
/// and this machine say of it.
struct InfoLine {
  std::string name, value;
};
/// The CUDA side of `shardtrain env`: the CUDA runtime and driver, cuBLAS, cuBLASLt, cuDNN and
/// NCCL versions, the GPU architectures compiled in, and each GPU seen with whether this build
/// runs on it (machine code for its architecture, or PTX it can compile). A build without CUDA
/// says so in one line. Never throws: a failing query is reported as its line's value.
std::vector<InfoLine> cuda_info();

}  // namespace shardtrain
