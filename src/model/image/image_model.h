// ImageModel: an image classifier as a Model (model/model.h) — a list of top-level modules
// (torchvision's "features.0", ..., "classifier"), each one layer of the flat parameter layout,
// ending in class logits [N, K] and a label-smoothed softmax cross-entropy. An ensemble runs
// several such lists (its members) on the same images and averages their logits.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memory/host_buffer.h"
#include "model/image/image_module.h"
#include "model/model.h"

namespace shardtrain {

/// What an image model is built for: the input (from the data set) and the class count.
struct ImageModelSpec {
  std::string name;          ///< "cnn", "mobilenet_v2", ...
  int64_t channels = 1;      ///< input channels C
  int64_t height = 28;       ///< input height H (pixels)
  int64_t width = 28;        ///< input width W (pixels)
  int64_t num_classes = 10;  ///< K
  /// Build with the architecture's dropout and stochastic depth (false: p = 0 everywhere, e.g.
  /// for parity tests against a reference with them off).
  bool dropout = true;
  /// When ≥ 0 (and `dropout`): the classifier's dropout probability instead of the
  /// architecture's (torchvision's `dropout=` argument; --dropout).
  float classifier_dropout = -1;
  /// The classifier's dropout probability: 0 without `dropout`, else classifier_dropout when
  /// set, else the architecture's `p`.
  float classifier_dropout_or(float p) const {
    return !dropout ? 0.0f : classifier_dropout >= 0 ? classifier_dropout : p;
  }
};

class ImageModel final : public Model {
 public:
  /// `layers`: the top-level modules in order; the last must output [N, K, 1, 1]. Checks every
  /// shape for spec's input now. Throws ConfigError (naming the module) when the input is too
  /// small for the network's downsampling or the classifier does not output K classes.
  ImageModel(ImageModelSpec spec, std::vector<ModulePtr> layers, Backend& backend);
  /// An ensemble: each member's layers (in order) run on the same input and its logits are
  /// averaged (the mean of the members' logits goes to the loss). The layers of all members are
  /// the model's layers, member after member, so each is one layer of the flat layout.
  ImageModel(ImageModelSpec spec, std::vector<std::vector<ModulePtr>> members, Backend& backend);
  ~ImageModel() override;

  std::string name() const override { return spec_.name; }
  const ImageModelSpec& spec() const { return spec_; }
  const ParamLayout& layout() const override { return layout_; }
  Backend& backend() override { return backend_; }
  Module& layer(int i) { return *layers_[static_cast<size_t>(i)]; }

  void bind(const Tensor& params, const Tensor& grads) override;
  void bind_layer(int layer, const LayerRange& r, Tensor params, Tensor grads) override;
  void init_parameters(float* host_params, uint64_t seed) const override;

  /// Label smoothing ε of the training loss (0 = plain cross-entropy).
  void set_label_smoothing(float eps) { label_smoothing_ = eps; }
  /// Synchronized batch norm: `sum` all-reduces an fp32 tensor in place across `ranks`
  /// data-parallel ranks (null: per-rank statistics).
  void set_sync_batchnorm(std::function<void(Tensor)> sum, int64_t ranks);

  double forward(const ModelInput& input, float grad_scale, bool for_backward) override;
  void backward() override;
  /// On a backend with device graphs (CUDA) and with set_cuda_graphs(true): the first
  /// micro-batch of a shape runs eagerly (cuDNN's algorithm search, buffers sized), the next one
  /// is captured as one graph of the whole forward and backward, and later ones replay it after
  /// uploading their images, targets and dropout seed into the same device buffers — the host
  /// enqueues one launch instead of hundreds of kernels. Falls back to forward() + backward()
  /// when the hooks are not capturable (a strategy gathering parameters or reducing gradients
  /// during backward; see prepare_cuda_graphs), with synchronized batch norm, and for good (with
  /// a warning) when a capture fails. Same results as eager.
  double train_micro_batch(const ModelInput& input, float grad_scale) override;
  /// Whether train_micro_batch may use device graphs (default off).
  void set_cuda_graphs(bool on) { graphs_ = on; }
  /// After the strategy has bound its hooks, with set_cuda_graphs(true): asks hooks that are not
  /// capturable to allow capture (LayerHooks::allow_capture — data parallelism then all-reduces
  /// the gradients right after the step's last replay instead of during backward).
  void prepare_cuda_graphs() {
    if (graphs_ && hooks_ && !hooks_->capturable()) hooks_->allow_capture();
  }
  /// Whether train_micro_batch replays device graphs: set_cuda_graphs(true), no failed capture
  /// so far, capturable hooks (or none) and no synchronized batch norm.
  bool cuda_graphs_usable() const {
    return graphs_ && (!hooks_ || hooks_->capturable()) && !sync_sum_;
  }
  /// Micro-batches run by replaying a graph so far (for tests and the run's log).
  int64_t graph_replays() const { return graph_replays_; }
  /// Evaluation forward (running batch-norm statistics, no dropout): logits [batch, K] fp32 on
  /// the host, row-major.
  std::vector<float> predict(const float* images, int64_t batch);

  double train_flops_per_sample(int64_t seq_len) const override;
  /// Multiply-accumulates of one forward per image.
  int64_t macs_per_image() const;

  /// The parameter names of the classifier head: the last layer of the model (of each member,
  /// for an ensemble) — the Linear whose output is the K class logits (torchvision's
  /// "classifier.1.weight"/".bias" for mobilenet_v2 and efficientnet_b0, "classifier.6.*" for
  /// VGG, "classifier.*" for cnn and cnn_lstm, "members.<i>.classifier*" in an ensemble). These
  /// are the tensors --init-from --replace-head keeps freshly initialized.
  std::vector<std::string> head_parameter_names() const;

  /// Batch norm's running statistics as Model state buffers (buffer_specs() order).
  std::vector<ModelBuffer> state_buffers() const override;
  void read_state_buffers(float* dst) override;
  void write_state_buffers(const float* src) override;

  /// The fp32 buffers (batch norm's running statistics), in buffer_specs() order, on the device.
  const std::vector<BufferSpec>& buffer_specs() const { return buffer_specs_; }
  Tensor buffers() const { return buffers_.view(); }

 private:
  Tensor run_forward(ModuleContext& ctx, const float* images, int64_t batch);
  /// Whether the uploaded NCHW images are relaid out for the ops (channels-last, C > 1).
  bool relayout_input() const { return ops_.channels_last() && spec_.channels > 1; }
  /// Checks a micro-batch, keeps its batch size and dropout seed, and enqueues the uploads of its
  /// images and targets.
  void stage(const ModelInput& input);
  /// Enqueues the copy of host images [batch, C, H, W] fp32 into the device buffer the input's
  /// conversions start from (asynchronous: `images` must stay unchanged until the stream ran it).
  void upload_images(const float* images, int64_t batch);
  /// Enqueues the copy of uint8 pixels [batch, C, H, W] (asynchronous, as upload_images); the
  /// normalization `affine` [2·C] is copied when it changed.
  void upload_pixels(const uint8_t* pixels, const float* affine, int64_t batch);
  /// The uploaded images in the compute dtype and the ops' layout (conversions enqueued).
  Tensor device_images(int64_t batch);
  /// Every member's layers on `x`; the logits [batch, K] (the members' mean for an ensemble).
  Tensor run_layers(ModuleContext& ctx, Tensor x, int64_t batch);
  /// Uploads a micro-batch's targets (asynchronous, as upload_images) and sizes the losses.
  void upload_targets(const int32_t* targets, int64_t batch);
  /// Forward of the uploaded micro-batch and its loss: the per-image losses, and ∂/∂logits in
  /// logits_ for backward.
  void forward_loss(ModuleContext& ctx, float grad_scale, bool for_backward);
  /// The mean of the last forward's per-image losses (waits for the device).
  double mean_loss();
  ModuleContext context(bool training, bool for_backward, uint64_t dropout_seed);
  ParamSource source_for(int layer, const LayerRange& r, Tensor params, Tensor grads);

  ImageModelSpec spec_;
  std::vector<ModulePtr> layers_;
  /// First layer of each member, then layers_.size() (one member: {0, size}).
  std::vector<size_t> member_begin_;
  Backend& backend_;
  ImageOps& ops_;
  ParamLayout layout_;
  std::vector<BufferSpec> buffer_specs_;
  std::vector<int64_t> buffer_offsets_;
  FlatBuffer buffers_;
  std::vector<Tensor> inputs_;  ///< each layer's input of the last forward
  FlatBuffer image_f32_, image_nchw_, image_, targets_, losses_;
  FlatBuffer pixels_, pixel_affine_;      ///< the uint8 input path (ModelInput::pixels)
  std::vector<float> pixel_affine_host_;  ///< what pixel_affine_ holds
  bool staged_pixels_ = false;            ///< the last staged micro-batch came as pixels
  FlatBuffer logit_sum_, member_grad_;    ///< ensembles: the mean of the logits, and its gradient
  uint64_t dropout_seed_ = 0;             ///< of the last forward, for backward's masks
  float label_smoothing_ = 0;
  std::function<void(Tensor)> sync_sum_;
  int64_t sync_ranks_ = 1;
  int64_t batch_ = 0;
  Tensor logits_;

  // ---- device graphs (train_micro_batch) ----
  struct GraphKey {
    int64_t batch = 0;
    float grad_scale = 0, label_smoothing = 0;
    bool pixels = false;  ///< the input path the graph reads (uint8 pixels or fp32 images)
    bool operator==(const GraphKey&) const = default;
  };
  bool graphs_ = false;
  bool seed_on_device_ = false;  ///< context() passes seed_ to the dropout masks
  std::unique_ptr<Backend::Graph> graph_;
  GraphKey graph_key_;              ///< what graph_ was captured for
  std::optional<GraphKey> warmed_;  ///< the shape of the last eager micro-batch
  FlatBuffer seed_;                 ///< the micro-batch's dropout seed, uint64 on the device
  PinnedBuffer seed_host_;          ///< its host side
  int64_t graph_replays_ = 0;
};

}  // namespace shardtrain
