// Times the CUDA image ops one by one (device time per call, bf16) on the shapes of MobileNetV2's
// and VGG's layers at 32×32, batch 256, to find what a model's step spends its time on. Not a test.
// Usage (GPU machine): bench_image_ops [reps (default 20)]
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "memory/flat_buffer.h"

using namespace shardtrain;

namespace {

struct Bench {
  Backend& be;
  ImageOps& ops;
  int reps;
  std::vector<FlatBuffer> keep;

  Tensor t(std::initializer_list<int64_t> dims, DType dt = DType::kBF16) {
    const Tensor shape(nullptr, dt, DeviceKind::kCUDA, dims);
    keep.emplace_back(be, dt, shape.numel());
    return Tensor(keep.back().data(), dt, DeviceKind::kCUDA, dims);
  }
  /// Mean device milliseconds of `f` over `reps` calls (after one warm-up call).
  double time(const std::function<void()>& f) {
    f();
    auto clock = be.make_stream_clock();
    clock->mark();
    for (int i = 0; i < reps; ++i) f();
    clock->mark();
    return 1e3 * clock->intervals().at(0) / reps;
  }
  void conv(const char* what, Conv2dShape s) {
    Tensor x = t({s.N, s.C, s.H, s.W}), w = t({s.K, s.C / s.groups, s.R, s.S});
    Tensor y = t({s.N, s.K, s.P(), s.Q()}), dx = t({s.N, s.C, s.H, s.W});
    Tensor dw = t({s.K, s.C / s.groups, s.R, s.S});
    const double f = time([&] { ops.conv2d_forward(y, x, w, {}, s); });
    const double b = time([&] { ops.conv2d_backward(dx, dw, {}, y, x, w, s); });
    const double bw = time([&] { ops.conv2d_backward({}, dw, {}, y, x, w, s); });
    std::printf("%-44s fwd %8.3f ms | bwd %8.3f ms (weight grad alone %8.3f)\n", what, f, b, bw);
  }
  void batchnorm(const char* what, int64_t N, int64_t C, int64_t H, int64_t W) {
    Tensor x = t({N, C, H, W}), y = t({N, C, H, W}), g = t({C}), b = t({C});
    Tensor dg = t({C}), db = t({C}), dx = t({N, C, H, W});
    Tensor mean = t({C}, DType::kF32), invstd = t({C}, DType::kF32);
    Tensor rm = t({C}, DType::kF32), rv = t({C}, DType::kF32);
    Tensor sums = t({2, C}, DType::kF64), dsums = t({2, C}, DType::kF64);
    const int64_t count = N * H * W;
    const double f = time([&] {
      ops.batchnorm_statistics(sums, x);
      ops.batchnorm_forward_train(y, mean, invstd, rm, rv, x, g, b, sums, count, 1e-5f, 0.1f,
                                  Activation::kRelu6);
    });
    const double bw = time([&] {
      ops.batchnorm_backward_reduce(dsums, dg, db, y, x, g, b, mean, invstd, Activation::kRelu6);
      ops.batchnorm_backward_input(dx, y, x, g, b, mean, invstd, dsums, count, Activation::kRelu6);
    });
    std::printf("%-44s fwd %8.3f ms | bwd %8.3f ms\n", what, f, bw);
  }
};

Conv2dShape conv(int64_t N, int64_t C, int64_t H, int64_t K, int64_t R, int64_t stride,
                 int64_t groups) {
  return {.N = N,
          .C = C,
          .H = H,
          .W = H,
          .K = K,
          .R = R,
          .S = R,
          .stride_h = stride,
          .stride_w = stride,
          .pad_h = R / 2,
          .pad_w = R / 2,
          .groups = groups};
}

}  // namespace

int main(int argc, char** argv) {
  if (!cuda_available()) {
    std::fprintf(stderr, "bench_image_ops: no CUDA GPU\n");
    return 1;
  }
  auto be = make_cuda_backend(0, DType::kBF16);
  Bench b{*be, *be->image_ops(), argc > 1 ? std::atoi(argv[1]) : 20, {}};
  std::printf("device: %s, %s, device time per call\n", be->description().c_str(),
              dtype_name(be->compute_dtype()));
  b.conv("mobilenet 1x1 expand 24->144 @8x8", conv(256, 24, 8, 144, 1, 1, 1));
  b.conv("mobilenet 1x1 project 144->24 @8x8", conv(256, 144, 8, 24, 1, 1, 1));
  b.conv("mobilenet 1x1 expand 64->384 @2x2", conv(256, 64, 2, 384, 1, 1, 1));
  b.conv("mobilenet depthwise 3x3 144 @8x8", conv(256, 144, 8, 144, 3, 1, 144));
  b.conv("mobilenet depthwise 3x3 s2 96 @16x16", conv(256, 96, 16, 96, 3, 2, 96));
  b.conv("mobilenet depthwise 3x3 384 @2x2", conv(256, 384, 2, 384, 3, 1, 384));
  b.conv("vgg 3x3 64->64 @32x32", conv(256, 64, 32, 64, 3, 1, 1));
  b.conv("vgg 3x3 512->512 @2x2", conv(256, 512, 2, 512, 3, 1, 1));
  b.batchnorm("batchnorm+relu6 [256,144,8,8]", 256, 144, 8, 8);
  b.batchnorm("batchnorm+relu6 [256,384,2,2]", 256, 384, 2, 2);
  b.batchnorm("batchnorm+relu6 [256,64,32,32]", 256, 64, 32, 32);
  return 0;
}
