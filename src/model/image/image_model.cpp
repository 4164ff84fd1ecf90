#include "model/image/image_model.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "core/error.h"

namespace shardtrain {
namespace {

ImageOps& ops_of(Backend& be) {
  ImageOps* ops = be.image_ops();
  if (!ops)
    throw ConfigError(fmt::format(
        "the {} backend has no image-model ops (convolution, batch norm, pooling); train image "
        "models on the CPU or CUDA backend",
        be.description()));
  return *ops;
}

Tensor shaped(const Tensor& t, const std::vector<int64_t>& shape) {
  Tensor out = t;
  out.ndim = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) out.shape[i] = shape[i];
  return out;
}

}  // namespace

namespace {
std::vector<std::vector<ModulePtr>> one_member(std::vector<ModulePtr> layers) {
  std::vector<std::vector<ModulePtr>> m;
  m.push_back(std::move(layers));
  return m;
}
}  // namespace

ImageModel::ImageModel(ImageModelSpec spec, std::vector<ModulePtr> layers, Backend& backend)
    : ImageModel(std::move(spec), one_member(std::move(layers)), backend) {}

ImageModel::ImageModel(ImageModelSpec spec, std::vector<std::vector<ModulePtr>> members,
                       Backend& backend)
    : spec_(std::move(spec)), backend_(backend), ops_(ops_of(backend)) {
  check<ConfigError>(!members.empty(), "image model {} has no layers", spec_.name);
  for (auto& member : members) {
    check<ConfigError>(!member.empty(), "image model {} has a member without layers", spec_.name);
    member_begin_.push_back(layers_.size());
    ImageShape s{1, spec_.channels, spec_.height, spec_.width};
    for (const auto& l : member) s = l->output_shape(s);
    check<ConfigError>(s.C == spec_.num_classes && s.H == 1 && s.W == 1,
                       "image model {} outputs [{}, {}, {}] per image, not {} class logits",
                       spec_.name, s.C, s.H, s.W, spec_.num_classes);
    for (auto& l : member) layers_.push_back(std::move(l));
  }
  member_begin_.push_back(layers_.size());
  for (const auto& l : layers_) {
    std::vector<ParamTensor> tensors;
    l->param_specs(tensors);
    layout_.add_layer(l->name(), std::move(tensors));
    l->buffer_specs(buffer_specs_);
  }
  int64_t total = 0;
  std::vector<float> init;
  for (const BufferSpec& b : buffer_specs_) {
    buffer_offsets_.push_back(total);
    total += b.numel;
    init.insert(init.end(), static_cast<size_t>(b.numel), b.init_value);
  }
  if (total > 0) {
    buffers_ = FlatBuffer(backend_, DType::kF32, total);
    backend_.copy_from_host(buffers_.data(), init.data(), init.size() * sizeof(float));
  }
}

ImageModel::~ImageModel() = default;

std::vector<std::string> ImageModel::head_parameter_names() const {
  std::vector<std::string> names;
  for (size_t m = 1; m < member_begin_.size(); ++m) {
    const LayerRange& head = layout_.layers()[member_begin_[m] - 1];
    for (const ParamTensor& t : head.tensors) names.push_back(t.name);
  }
  return names;
}

std::vector<ModelBuffer> ImageModel::state_buffers() const {
  std::vector<ModelBuffer> out;
  for (const BufferSpec& b : buffer_specs_) out.push_back({b.name, b.numel});
  return out;
}

void ImageModel::read_state_buffers(float* dst) {
  if (buffers_.numel() > 0)
    backend_.copy_to_host(dst, buffers_.data(), static_cast<size_t>(buffers_.numel()) * 4);
}

void ImageModel::write_state_buffers(const float* src) {
  if (buffers_.numel() > 0)
    backend_.copy_from_host(buffers_.data(), src, static_cast<size_t>(buffers_.numel()) * 4);
}

ParamSource ImageModel::source_for(int layer, const LayerRange& r, Tensor params, Tensor grads) {
  ParamSource src;
  src.param = [this, layer, r, params, grads](const std::string& name) {
    for (const ParamTensor& t : r.tensors)
      if (t.name == name) {
        // ZeRO-3 binds a sharded layer to empty tensors until it gathers its parameters.
        if (params.empty()) return std::pair{Tensor(), Tensor()};
        const int64_t off = t.offset - r.offset;
        return std::pair{shaped(params.slice1d(off, t.numel), t.shape),
                         grads.empty() ? Tensor() : shaped(grads.slice1d(off, t.numel), t.shape)};
      }
    throw RuntimeFailure(
        fmt::format("layer {} of {} has no parameter {}", layer, spec_.name, name));
  };
  src.buffer = [this](const std::string& name) {
    for (size_t i = 0; i < buffer_specs_.size(); ++i)
      if (buffer_specs_[i].name == name)
        return buffers_.slice(buffer_offsets_[i], buffer_specs_[i].numel);
    throw RuntimeFailure(fmt::format("{} has no buffer {}", spec_.name, name));
  };
  return src;
}

void ImageModel::bind(const Tensor& params, const Tensor& grads) {
  for (int i = 0; i < num_layers(); ++i) {
    const LayerRange& r = layout_.layers()[static_cast<size_t>(i)];
    bind_layer(i, r, params.slice1d(r.offset, r.numel),
               grads.empty() ? Tensor() : grads.slice1d(r.offset, r.numel));
  }
}

void ImageModel::bind_layer(int layer, const LayerRange& r, Tensor params, Tensor grads) {
  layers_[static_cast<size_t>(layer)]->bind(source_for(layer, r, params, grads));
}

void ImageModel::init_parameters(float* host_params, uint64_t seed) const {
  init_layout_parameters(layout_, host_params, seed);
}

void ImageModel::set_sync_batchnorm(std::function<void(Tensor)> sum, int64_t ranks) {
  sync_sum_ = std::move(sum);
  sync_ranks_ = ranks;
}

ModuleContext ImageModel::context(bool training, bool for_backward, uint64_t dropout_seed) {
  ModuleContext ctx{backend_, ops_, training, for_backward, {}, 1, dropout_seed};
  if (seed_on_device_) ctx.dropout_seed_device = static_cast<const uint64_t*>(seed_.data());
  if (training && sync_sum_) {
    ctx.sync_sums = sync_sum_;
    ctx.sync_ranks = sync_ranks_;
  }
  return ctx;
}

void ImageModel::upload_images(const float* images, int64_t batch) {
  const int64_t n = batch * spec_.channels * spec_.height * spec_.width;
  const DType dt = backend_.compute_dtype();
  // Chain: host fp32 NCHW → [fp32 staging → compute dtype] → [NCHW → channels-last] → image_.
  grow(backend_, image_, dt, n);
  if (relayout_input()) grow(backend_, image_nchw_, dt, n);
  if (dt != DType::kF32) grow(backend_, image_f32_, DType::kF32, n);
  void* first = dt != DType::kF32  ? image_f32_.data()
                : relayout_input() ? image_nchw_.data()
                                   : image_.data();
  backend_.copy_from_host_async(first, images, static_cast<size_t>(n) * sizeof(float));
}

void ImageModel::upload_pixels(const uint8_t* pixels, const float* affine, int64_t batch) {
  const int64_t n = batch * spec_.channels * spec_.height * spec_.width;
  grow(backend_, image_, backend_.compute_dtype(), n);
  grow(backend_, pixels_, DType::kU8, n);
  const auto C = static_cast<size_t>(spec_.channels);
  if (pixel_affine_.numel() == 0)
    pixel_affine_ = FlatBuffer(backend_, DType::kF32, 2 * spec_.channels);
  if (!std::equal(affine, affine + 2 * C, pixel_affine_host_.begin(), pixel_affine_host_.end())) {
    pixel_affine_host_.assign(affine, affine + 2 * C);
    // Ordered after the replays that read the old values; rare (set once per run).
    backend_.copy_from_host(pixel_affine_.data(), pixel_affine_host_.data(), 2 * C * sizeof(float));
  }
  backend_.copy_from_host_async(pixels_.data(), pixels, static_cast<size_t>(n));
}

Tensor ImageModel::device_images(int64_t batch) {
  const DType dt = backend_.compute_dtype();
  const auto image = [&](void* data, DType t) {
    return Tensor(data, t, backend_.kind(), {batch, spec_.channels, spec_.height, spec_.width});
  };
  Tensor x = image(image_.data(), dt);
  if (staged_pixels_) {
    ops_.image_from_pixels(
        x, image(pixels_.data(), DType::kU8),
        Tensor(pixel_affine_.data(), DType::kF32, backend_.kind(), {2, spec_.channels}));
    return x;
  }
  Tensor nchw = relayout_input() ? image(image_nchw_.data(), dt) : x;
  if (dt != DType::kF32) backend_.convert(nchw, image(image_f32_.data(), DType::kF32));
  if (relayout_input()) ops_.image_from_nchw(x, nchw);
  return x;
}

Tensor ImageModel::run_forward(ModuleContext& ctx, const float* images, int64_t batch) {
  staged_pixels_ = false;
  upload_images(images, batch);
  return run_layers(ctx, device_images(batch), batch);
}

Tensor ImageModel::run_layers(ModuleContext& ctx, Tensor x, int64_t batch) {
  inputs_.resize(layers_.size());
  const size_t members = member_begin_.size() - 1;
  const DType dt = backend_.compute_dtype();
  Tensor sum;
  if (members > 1) {
    grow(backend_, logit_sum_, dt, batch * spec_.num_classes);
    sum = Tensor(logit_sum_.data(), dt, backend_.kind(), {batch, spec_.num_classes});
  }
  const Tensor image = x;
  for (size_t m = 0; m < members; ++m) {
    x = image;
    for (size_t i = member_begin_[m]; i < member_begin_[m + 1]; ++i) {
      if (hooks_) hooks_->before_forward(static_cast<int>(i));
      inputs_[i] = x;
      x = layers_[i]->forward(ctx, x);
      // Without backward, an output is dead once the next layer has read it.
      if (!ctx.for_backward && i > member_begin_[m]) layers_[i - 1]->release_output();
      if (hooks_) {
        hooks_->after_forward(static_cast<int>(i));
        hooks_->between_layers();
      }
    }
    if (members == 1) return Tensor(x.data, x.dtype, x.device, {batch, spec_.num_classes});
    const Tensor logits(x.data, x.dtype, x.device, {batch, spec_.num_classes});
    if (m == 0)
      backend_.copy(sum.data, logits.data, logits.bytes());
    else
      backend_.add(sum, sum, logits);
    layers_[member_begin_[m + 1] - 1]->release_output();  // in the sum now
  }
  backend_.scale(sum, 1.0f / static_cast<float>(members));
  return sum;
}

void ImageModel::upload_targets(const int32_t* targets, int64_t batch) {
  grow(backend_, targets_, DType::kI32, batch);
  grow(backend_, losses_, DType::kF32, batch);
  backend_.copy_from_host_async(targets_.data(), targets,
                                static_cast<size_t>(batch) * sizeof(int32_t));
}

void ImageModel::forward_loss(ModuleContext& ctx, float grad_scale, bool for_backward) {
  logits_ = run_layers(ctx, device_images(batch_), batch_);
  Tensor targets(targets_.data(), DType::kI32, backend_.kind(), {batch_});
  Tensor losses(losses_.data(), DType::kF32, backend_.kind(), {batch_});
  // Leaves ∂objective/∂logits in logits_ for backward().
  ops_.classification_loss(losses, logits_, targets, for_backward ? label_smoothing_ : 0.0f,
                           grad_scale);
}

double ImageModel::mean_loss() {
  return backend_.sum(Tensor(losses_.data(), DType::kF32, backend_.kind(), {batch_})) /
         static_cast<double>(batch_);
}

void ImageModel::stage(const ModelInput& input) {
  check<ConfigError>(
      (input.images || (input.pixels && input.pixel_affine)) && input.targets && input.batch > 0,
      "{} takes images (or pixels and their normalization) and class targets", spec_.name);
  dropout_seed_ = input.dropout_seed;
  batch_ = input.batch;
  staged_pixels_ = input.images == nullptr;
  if (staged_pixels_)
    upload_pixels(input.pixels, input.pixel_affine, batch_);
  else
    upload_images(input.images, batch_);
  upload_targets(input.targets, batch_);
}

double ImageModel::forward(const ModelInput& input, float grad_scale, bool for_backward) {
  stage(input);
  ModuleContext ctx = context(for_backward, for_backward, dropout_seed_);
  forward_loss(ctx, grad_scale, for_backward);
  return mean_loss();  // waits for the device: the uploads are done when forward returns
}

double ImageModel::train_micro_batch(const ModelInput& input, float grad_scale) {
  if (!cuda_graphs_usable()) return Model::train_micro_batch(input, grad_scale);
  stage(input);
  if (seed_.numel() == 0) {
    seed_ = FlatBuffer(backend_, DType::kI32, 2);
    seed_host_ = PinnedBuffer(backend_, DType::kI32, 2);
  }
  // The last micro-batch's copy of the seed has run: its loss was read (mean_loss waits).
  std::memcpy(seed_host_.data(), &dropout_seed_, sizeof(uint64_t));
  backend_.copy_from_host_async(seed_.data(), seed_host_.data(), sizeof(uint64_t));
  const auto run = [&] {
    seed_on_device_ = true;
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{seed_on_device_};
    ModuleContext ctx = context(true, true, dropout_seed_);
    forward_loss(ctx, grad_scale, true);
    backward();
  };
  const GraphKey key{batch_, grad_scale, label_smoothing_, staged_pixels_};
  if (graph_ && !(graph_->valid() && graph_key_ == key)) graph_.reset();
  // A new shape runs eagerly first (algorithm search, buffers sized); the next one is captured.
  if (!graph_ && warmed_ == key) {
    try {
      graph_ = backend_.capture(run);
    } catch (const RuntimeFailure& e) {
      fmt::print(stderr, "shardtrain: warning: {}\n", e.what());
    }
    graph_key_ = key;
    if (!graph_) graphs_ = false;  // for good: the micro-batches run eagerly
  }
  if (!graph_) {
    warmed_ = key;
    run();
    return mean_loss();
  }
  graph_->replay();
  ++graph_replays_;
  return mean_loss();
}

void ImageModel::backward() {
  ModuleContext ctx = context(true, true, dropout_seed_);
  const size_t members = member_begin_.size() - 1;
  const auto is_first = [&](size_t k) {
    return std::find(member_begin_.begin(), member_begin_.end(), k) != member_begin_.end();
  };
  Tensor g(logits_.data, logits_.dtype, logits_.device, {batch_, spec_.num_classes, 1, 1});
  Tensor member_g = g;
  if (members > 1) {
    // ∂/∂(member logits) = ∂/∂(mean) / members, the same for every member.
    grow(backend_, member_grad_, logits_.dtype, logits_.numel());
    member_g = Tensor(member_grad_.data(), g.dtype, g.device, {batch_, spec_.num_classes, 1, 1});
    backend_.copy(member_g.data, g.data, g.bytes());
    backend_.scale(member_g, 1.0f / static_cast<float>(members));
  }
  // As Sequential::backward: ∂L/∂(input of layer k) is taken for layer k's backward and returned
  // after layer k−1's; layer k−1's output is returned after layer k's backward, its last reader.
  FlatBuffer g_buf;  // holds g unless g is a member's logit gradient
  for (size_t k = layers_.size(); k-- > 0;) {
    if (hooks_) hooks_->before_backward(static_cast<int>(k));
    const bool last = is_first(k + 1);  // a member's last layer
    if (last) g = member_g;
    Tensor target;
    FlatBuffer target_buf;
    if (!is_first(k)) {
      const Tensor& in = inputs_[k];
      target_buf = FlatBuffer::uninitialized(backend_, in.dtype, in.numel());
      target = Tensor(target_buf.data(), in.dtype, in.device,
                      {in.shape[0], in.shape[1], in.shape[2], in.shape[3]});
    }
    layers_[k]->backward(ctx, inputs_[k], g, target);
    // A single model's logits (now their gradient) are the last layer's output.
    if (last) layers_[k]->release_output();
    if (!is_first(k)) layers_[k - 1]->release_output();
    if (hooks_) {
      hooks_->after_backward(static_cast<int>(k));
      hooks_->between_layers();
    }
    g_buf = std::move(target_buf);
    g = target;
  }
}

std::vector<float> ImageModel::predict(const float* images, int64_t batch) {
  ModuleContext ctx = context(false, false, 0);
  const Tensor logits = run_forward(ctx, images, batch);
  std::vector<float> out(static_cast<size_t>(logits.numel()));
  if (logits.dtype == DType::kF32) {
    backend_.copy_to_host(out.data(), logits.data, logits.bytes());
  } else {
    FlatBuffer tmp(backend_, DType::kF32, logits.numel());
    backend_.convert(Tensor(tmp.data(), DType::kF32, backend_.kind(), {batch, spec_.num_classes}),
                     logits);
    backend_.copy_to_host(out.data(), tmp.data(), out.size() * sizeof(float));
  }
  layers_.back()->release_output();  // the logits (a single model's), now on the host
  return out;
}

int64_t ImageModel::macs_per_image() const {
  int64_t total = 0;
  for (size_t m = 0; m + 1 < member_begin_.size(); ++m) {
    ImageShape s{1, spec_.channels, spec_.height, spec_.width};
    for (size_t i = member_begin_[m]; i < member_begin_[m + 1]; ++i) {
      total += layers_[i]->macs_per_image(s);
      s = layers_[i]->output_shape(s);
    }
  }
  return total;
}

double ImageModel::train_flops_per_sample(int64_t) const {
  // forward 2·MACs, backward 4·MACs (input and weight gradients)
  return 6.0 * static_cast<double>(macs_per_image());
}

}  // namespace shardtrain
