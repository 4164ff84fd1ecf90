// Image-model blocks beyond image_module.h's basics: dropout, squeeze-and-excitation, stochastic
// depth, an LSTM over a feature map's rows, and the reshape that feeds it. Names follow
// torchvision / PyTorch so parameters carry their state-dict names.
#pragma once

#include <string>

#include "model/image/image_module.h"

namespace shardtrain {

/// nn.Dropout(p) (inverted dropout, Srivastava et al., JMLR 15 (2014)): in training, element i
/// is kept with probability 1 − p and scaled by 1/(1 − p); its mask is Philox of (the
/// micro-batch's dropout seed, the module's site, i), regenerated in backward. Identity when not
/// training or p = 0.
ModulePtr make_dropout(const std::string& name, float p);

/// torchvision.ops.SqueezeExcitation (Hu et al., arXiv 1709.01507, §3) as EfficientNet uses it:
/// s = σ(fc2(SiLU(fc1(avgpool(x))))), out = x · s per channel; fc1 and fc2 are 1×1 convolutions
/// with biases ("<name>.fc1", "<name>.fc2"; kaiming-normal fan-out weights, zero biases).
ModulePtr make_squeeze_excitation(const std::string& name, int64_t channels, int64_t squeeze,
                                  Activation act = Activation::kSilu);

/// torchvision.ops.StochasticDepth(p, "row") (Huang et al., arXiv 1603.09382, §3): in training
/// each sample is kept with probability 1 − p and scaled by 1/(1 − p), or zeroed whole; identity
/// when not training or p = 0. The per-sample draws are SplitMix64 of (the micro-batch's dropout
/// seed, the module's site, the sample index).
ModulePtr make_stochastic_depth(const std::string& name, float p);

/// The rows of a feature map as a sequence: [N, C, H, W] → [N, H, C·W] (step t = row t, features
/// c·W + w), shaped as ImageShape {N, H, C·W, 1}. As PyTorch's x.permute(0, 2, 1, 3).flatten(2).
ModulePtr make_rows_to_sequence(const std::string& name);

/// nn.LSTM(input, hidden, batch_first=True), one layer, zero initial state, over a sequence
/// shaped {N, L, input, 1}; outputs the LAST step's hidden state h_L as {N, hidden, 1, 1}.
/// Parameters "<name>.weight_ih_l0" [4H, I], "weight_hh_l0" [4H, H], "bias_ih_l0", "bias_hh_l0"
/// [4H] (gates i, f, g, o), initialized uniform(−1/√H, 1/√H) as PyTorch.
ModulePtr make_lstm(const std::string& name, int64_t input_size, int64_t hidden_size);

}  // namespace shardtrain
