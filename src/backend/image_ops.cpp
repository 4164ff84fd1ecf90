// Names of the ImageOps activations (for messages and logs), and the NCHW defaults of the layout
// methods.
#include "backend/image_ops.h"

#include "core/error.h"

namespace shardtrain {

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kNone:
      return "none";
    case Activation::kRelu:
      return "relu";
    case Activation::kRelu6:
      return "relu6";
    case Activation::kSilu:
      return "silu";
    case Activation::kSigmoid:
      return "sigmoid";
  }
  return "unknown";
}

void ImageOps::set_channels_last(bool on) {
  check<RuntimeFailure>(!on, "this backend's image ops store images NCHW only");
}

void ImageOps::image_rows_as_sequence(Tensor out, Tensor inp) {
  check<RuntimeFailure>(!channels_last(), "image_rows_as_sequence: no channels-last version");
  const int64_t N = inp.dim(0), C = inp.dim(1), H = inp.dim(2), W = inp.dim(3);
  swap_middle_axes(out.reshape({N, H, C, W}), inp);
}

void ImageOps::sequence_as_image_rows(Tensor dinp, Tensor dout) {
  check<RuntimeFailure>(!channels_last(), "sequence_as_image_rows: no channels-last version");
  const int64_t N = dinp.dim(0), C = dinp.dim(1), H = dinp.dim(2), W = dinp.dim(3);
  swap_middle_axes(dinp, dout.reshape({N, H, C, W}));
}

}  // namespace shardtrain
