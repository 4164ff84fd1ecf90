// Image classification data: Fashion-MNIST (IDX files), ImageFolder-style directories (one
// subfolder per class, PNG or JPEG), a held-out split, and the batch transform (resize, random
// crop with padding, horizontal flip, per-channel normalization).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace shardtrain {

/// Decoded images of one size, uint8 planar: image i's channel c row y column x is
/// pixels[((i·C + c)·H + y)·W + x]. labels[i] ∈ [0, classes.size()).
struct ImageSet {
  std::string name;  ///< for messages ("fashion-mnist train", a directory)
  int64_t channels = 0, height = 0, width = 0;
  std::vector<uint8_t> pixels;
  std::vector<int32_t> labels;
  std::vector<std::string> classes;  ///< class names, index = label

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  int64_t image_bytes() const { return channels * height * width; }
  const uint8_t* image(int64_t i) const { return pixels.data() + i * image_bytes(); }
};

/// Fashion-MNIST's class names (Xiao, Rasul and Vollgraf, arXiv 1708.07747, table 1).
const std::vector<std::string>& fashion_mnist_classes();

/// Where Fashion-MNIST is looked for: $SHARDTRAIN_DATA_DIR/fashion-mnist, shardtrain's data
/// directory's fashion-mnist/, then /usr/share/datasets/fashion-mnist (Debian's
/// `dataset-fashion-mnist` package). The first that holds train-images-idx3-ubyte(.gz) wins.
/// Throws DataError listing the places and the fix (apt-get install dataset-fashion-mnist, or
/// --data-dir DIR with the four IDX files) when none does.
std::filesystem::path find_fashion_mnist_dir();

/// Fashion-MNIST's 60,000 training or 10,000 test images (1×28×28) from `dir` (plain or .gz
/// IDX files: train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-...). Throws DataError
/// naming the file when one is missing or corrupt, or images and labels disagree in count.
ImageSet load_fashion_mnist(const std::filesystem::path& dir, bool train);

/// An ImageFolder-style directory (as torchvision.datasets.ImageFolder): root/<class>/<image>,
/// classes sorted by name, images (.png, .jpg, .jpeg) sorted by name within each. When
/// `height`, `width` > 0 every image is resized to them (bilinear); otherwise all must share one
/// size. Gray images are kept gray when every image is gray, else replicated to RGB. Throws
/// DataError when root is missing, has no class subfolders or no images, an image cannot be
/// decoded (naming it), or sizes differ without a resize (naming two files and --image-size).
ImageSet load_image_folder(const std::filesystem::path& root, int64_t height = 0,
                           int64_t width = 0);

/// `count` random images (uniform bytes, seeded) of channels × height × width with random labels
/// in [0, classes): the shape of a data set without its content, as torchvision's FakeData, for
/// measuring speed. Deterministic in `seed`.
ImageSet synthetic_images(int64_t count, int64_t channels, int64_t height, int64_t width,
                          int64_t classes, uint64_t seed);

/// Resizes every image to height × width with bilinear interpolation (half-pixel centres, as
/// torch.nn.functional.interpolate(mode="bilinear", align_corners=False)). No-op when equal.
void resize_images(ImageSet& set, int64_t height, int64_t width);

/// Moves a deterministic `fraction` ∈ (0, 1) of `set` (a seeded shuffle, stratified by class so
/// every class keeps its share) into the returned held-out set. Throws ConfigError when the
/// fraction leaves either side empty.
ImageSet split_held_out(ImageSet& set, double fraction, uint64_t seed);

/// Per-channel mean and standard deviation of the pixels scaled to [0, 1] (double
/// accumulation): the normalization constants when none are given.
void channel_statistics(const ImageSet& set, std::vector<float>& mean, std::vector<float>& stdev);

/// What a batch does to each image. Augmentation (crop, flip) applies to training batches only.
struct ImageTransform {
  int64_t channels = 0;            ///< the model's input channels: gray is replicated to 3
  int crop_padding = 0;            ///< random crop of the image's size from a zero-padded copy
  bool horizontal_flip = false;    ///< flip with probability 1/2
  std::vector<float> mean, stdev;  ///< per input channel, applied to pixels / 255

  /// The normalization as an affine map of the raw pixel p ∈ [0, 255]: [2, C] fp32, scales
  /// 1/(255·stdev[c]) then shifts −mean[c]/stdev[c], so the model's input is p·scale + shift
  /// (ImageOps::image_from_pixels). Throws ConfigError unless mean and stdev hold C values.
  std::vector<float> affine() const;
};

/// Writes samples `indices[0..count)` of `set` as augmented, unnormalized pixels: `pixels`
/// [count, C, H, W] uint8 (C = transform.channels, gray replicated; H, W = the set's; a crop's
/// padding is 0) and `labels` [count] int32. Training batches draw their crop and flip from
/// (seed, epoch, sample index), so a sample's augmentation does not depend on the batch or rank
/// it lands in. The model normalizes them (transform.affine()) on its device: a quarter of the
/// bytes of fp32 to move. Throws ConfigError for a channel count the set cannot give (RGB to
/// gray).
void make_pixel_batch(const ImageSet& set, const ImageTransform& transform, const int64_t* indices,
                      int64_t count, bool train, uint64_t seed, int64_t epoch, uint8_t* pixels,
                      int32_t* labels);

/// make_pixel_batch followed by the normalization on the host: `images` [count, C, H, W] fp32,
/// element p·scale[c] + shift[c] of transform.affine(). Throws as make_pixel_batch, and
/// ConfigError when the normalization's channels are not C.
void make_image_batch(const ImageSet& set, const ImageTransform& transform, const int64_t* indices,
                      int64_t count, bool train, uint64_t seed, int64_t epoch, float* images,
                      int32_t* labels);

}  // namespace shardtrain
