// Image-model modules: the building blocks of the classifiers in model/image/ (convolution, batch
// norm, activations, pooling, linear, sequences and residual blocks), each with its forward and
// backward side by side, computed by a backend's ImageOps (backend/image_ops.h).
//
// A module is named like its torchvision counterpart ("features.3.conv.1"), so its parameters
// carry torchvision's state-dict names. It holds its output activation from its forward until its
// parent releases it (release_output), and keeps what its backward needs; backward receives the
// forward's input and the gradient of its output, and writes the gradient of its input (unless
// that is empty).
//
// Activation memory lives as long as autograd would keep it: a parent (Sequential, ImageModel)
// releases a module's output once the module after it has run its backward — or its forward,
// when no backward follows — and the gradients between modules are taken for one module's
// backward each. So at any point of a backward pass only the outputs still to be read and two
// activation gradients are held (on CUDA the caching allocator hands the same blocks to the next
// step, and a captured graph keeps them as its temporaries).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/image_ops.h"
#include "memory/flat_buffer.h"
#include "memory/param_layout.h"

namespace shardtrain {

/// An activation's shape: images [N, C, H, W]; a flat feature vector is [N, C, 1, 1].
struct ImageShape {
  int64_t N = 0, C = 0, H = 1, W = 1;
  int64_t numel() const { return N * C * H * W; }
  bool operator==(const ImageShape&) const = default;
};

/// A non-trained per-module state tensor kept in fp32 next to the parameters and saved with them
/// (batch norm's running_mean / running_var; torchvision's buffer names).
struct BufferSpec {
  std::string name;
  int64_t numel = 0;
  float init_value = 0;
};

/// Finds a bound parameter's value and gradient views by name (compute dtype; the gradient is
/// empty for inference), and a buffer's fp32 view.
struct ParamSource {
  std::function<std::pair<Tensor, Tensor>(const std::string&)> param;
  std::function<Tensor(const std::string&)> buffer;
};

/// What a forward or backward pass runs with.
struct ModuleContext {
  Backend& be;
  ImageOps& ops;
  bool training = true;      ///< batch norm uses batch statistics and updates the running ones
  bool for_backward = true;  ///< keep what backward needs
  /// Synchronized batch norm: all-reduces (sums) an fp32 tensor across the data-parallel ranks
  /// in place; null for per-rank statistics.
  std::function<void(Tensor)> sync_sums;
  /// Values per channel over all ranks' batch for synchronized batch norm (N·H·W · ranks).
  int64_t sync_ranks = 1;
  /// The micro-batch's dropout seed: Dropout and StochasticDepth draw their masks from it (and
  /// their site, a hash of the module's name), so backward regenerates forward's masks. Dropout
  /// is active only when `training`.
  uint64_t dropout_seed = 0;
  /// The same seed in device memory, which the masks then read instead (a replayed CUDA graph
  /// keeps the kernels' arguments of its capture); null: `dropout_seed` is passed.
  const uint64_t* dropout_seed_device = nullptr;
};

/// A module's dropout site: a 32-bit hash of its name (FNV-1a), distinct per module.
uint32_t dropout_site_of(const std::string& module_name);

class Module {
 public:
  explicit Module(std::string name) : name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  const std::string& name() const { return name_; }

  /// Appends the module's parameter tensors (torchvision names, shapes, init) in order.
  virtual void param_specs(std::vector<ParamTensor>& /*out*/) const {}
  /// Appends the module's fp32 buffers (running statistics).
  virtual void buffer_specs(std::vector<BufferSpec>& /*out*/) const {}
  /// Points the module at its parameters, gradients and buffers.
  virtual void bind(const ParamSource& /*src*/) {}
  /// The output shape for an input shape. Throws ConfigError when the input cannot be taken
  /// (e.g. smaller than a convolution's kernel), naming the module and both shapes.
  virtual ImageShape output_shape(const ImageShape& in) const = 0;
  /// Prepares for input shape `in`: the shapes of a container's children, and the buffers a
  /// module keeps across steps (batch-norm statistics). Outputs are taken by forward.
  virtual void reserve(Backend& /*be*/, const ImageShape& /*in*/) {}
  /// Runs forward on `in`; returns the output (held by the module until release_output()).
  virtual Tensor forward(ModuleContext& ctx, const Tensor& in) = 0;
  /// ∂L/∂in into `din` (overwrites; may be empty: skip) from ∂L/∂out `dout`; accumulates the
  /// parameter gradients. `in` is the forward's input; `dout` is not modified. Never reads the
  /// module's own output, which its parent may have released by then.
  virtual void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                        const Tensor& din) = 0;
  /// Returns the memory of the last forward's output to the backend (no-op when none is held);
  /// the next forward takes it again. A container releases its last child's output.
  virtual void release_output() { output_ = FlatBuffer(); }
  /// Multiply-accumulates of one forward per image for input shape `in` (for FLOPs and MFU: a
  /// forward is 2·MACs FLOPs, a training step ≈ 3× that).
  virtual int64_t macs_per_image(const ImageShape& /*in*/) const { return 0; }

 protected:
  /// The module's output tensor of `shape` in the compute dtype: the memory it holds when large
  /// enough, else taken (uninitialized) from the backend; forward overwrites all of it.
  Tensor output(Backend& be, const ImageShape& shape) { return activation(be, output_, shape); }
  /// A tensor of `shape` in `buf`, (re)allocated uninitialized in the compute dtype when too
  /// small.
  static Tensor activation(Backend& be, FlatBuffer& buf, const ImageShape& shape);

 private:
  std::string name_;
  FlatBuffer output_;  ///< the last forward's output, until release_output()
};

using ModulePtr = std::unique_ptr<Module>;

/// Modules run one after another (torch.nn.Sequential). Its children are named
/// "<name>.<index>" by the builders.
class Sequential final : public Module {
 public:
  explicit Sequential(std::string name) : Module(std::move(name)) {}
  Sequential& add(ModulePtr m) {
    children_.push_back(std::move(m));
    return *this;
  }
  size_t size() const { return children_.size(); }
  Module& child(size_t i) { return *children_[i]; }

  void param_specs(std::vector<ParamTensor>& out) const override;
  void buffer_specs(std::vector<BufferSpec>& out) const override;
  void bind(const ParamSource& src) override;
  ImageShape output_shape(const ImageShape& in) const override;
  void reserve(Backend& be, const ImageShape& in) override;
  /// Runs the children in order; without backward (ctx.for_backward false) each child's output
  /// is released as soon as the next child has read it.
  Tensor forward(ModuleContext& ctx, const Tensor& in) override;
  /// The children's backward in reverse; child k's output is released after child k+1's
  /// backward, and each gradient between children lives for the two backwards that use it.
  void backward(ModuleContext& ctx, const Tensor& in, const Tensor& dout,
                const Tensor& din) override;
  void release_output() override {
    if (!children_.empty()) children_.back()->release_output();
  }
  int64_t macs_per_image(const ImageShape& in) const override;

 private:
  std::vector<ModulePtr> children_;
  std::vector<ImageShape> shapes_;  ///< input shape of each child, then the output
  std::vector<Tensor> inputs_;      ///< each child's input of the last forward
};

/// How a convolution's weight is initialized.
enum class ConvInit {
  kKaimingFanOut,  ///< normal(0, √(2/fan_out)) (torchvision's MobileNetV2, EfficientNet, VGG)
  kKaimingFanIn,   ///< normal(0, √(2/fan_in))
};

/// nn.Conv2d(C, K, kernel, stride, padding, groups, bias), optionally followed by an activation
/// (fused into the op where the backend can).
struct Conv2dOptions {
  int64_t in_channels = 0, out_channels = 0, kernel = 3, stride = 1, padding = -1, groups = 1;
  bool bias = false;
  ConvInit init = ConvInit::kKaimingFanOut;
  // padding -1: kernel / 2 ("same" for odd kernels at stride 1)
};
ModulePtr make_conv2d(const std::string& name, const Conv2dOptions& o);

/// nn.BatchNorm2d(C, eps, momentum) followed by `act` (fused); γ = 1, β = 0 at init.
ModulePtr make_batchnorm2d(const std::string& name, int64_t channels,
                           Activation act = Activation::kNone, float eps = 1e-5f,
                           float momentum = 0.1f);

/// An element-wise activation (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Sigmoid).
ModulePtr make_activation(const std::string& name, Activation act);

/// nn.MaxPool2d(kernel, stride, padding).
ModulePtr make_maxpool2d(const std::string& name, int64_t kernel, int64_t stride,
                         int64_t padding = 0);

/// nn.AdaptiveAvgPool2d((out_h, out_w)).
ModulePtr make_adaptive_avgpool2d(const std::string& name, int64_t out_h, int64_t out_w);

/// out = in + body(in) (a residual connection around `body`, e.g. MobileNetV2's inverted
/// residual); the module takes `name` and `body` keeps its own (e.g. "<name>.conv").
ModulePtr make_residual(const std::string& name, ModulePtr body);

/// nn.Linear(in, out) on the flattened input ([N, C·H·W] → [N, out, 1, 1]); weight init
/// normal(0, init_std), or uniform(±init_uniform) when that is > 0; bias 0.
ModulePtr make_linear(const std::string& name, int64_t in_features, int64_t out_features,
                      float init_std = 0.01f, float init_uniform = 0.0f);

}  // namespace shardtrain
