// GPT-2 presets have exactly the published shapes, and the flat layout holds exactly those
// parameters (tied LM head counted once), with tensor offsets aligned and layers contiguous.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "memory/param_layout.h"
#include "model/gpt2.h"
#include "stage_parts.h"
#include "tiny_gpt2.h"

using namespace shardtrain;

TEST(Presets, PublishedParameterCounts) {
  auto be = make_cpu_backend();
  const std::pair<const char*, int64_t> published[] = {{"gpt2", 124'439'808},
                                                       {"gpt2-medium", 354'823'168},
                                                       {"gpt2-large", 774'030'080},
                                                       {"gpt2-xl", 1'557'611'200}};
  for (const auto& [name, count] : published) {
    const GPT2Config c = gpt2_preset(name);
    EXPECT_EQ(c.num_parameters(), count) << name;
    EXPECT_EQ(c.vocab_size, 50257) << name;
    EXPECT_EQ(c.n_positions, 1024) << name;
    GPT2Model model(c, *be);  // builds the layout only; allocates nothing
    EXPECT_EQ(model.layout().num_parameters(), count) << name;
    EXPECT_EQ(model.num_layers(), c.n_layer + 2) << name;
  }
}

TEST(Presets, LayoutIsContiguousAndAligned) {
  auto be = make_cpu_backend();
  GPT2Model model(gpt2_preset("gpt2-tiny"), *be);
  int64_t next = 0;
  for (const LayerRange& l : model.layout().layers()) {
    EXPECT_EQ(l.offset, next) << l.name;
    for (const ParamTensor& t : l.tensors) {
      EXPECT_EQ(t.offset % ParamLayout::kAlign, 0) << t.name;
      EXPECT_GE(t.offset, l.offset) << t.name;
      EXPECT_LE(t.offset + t.numel, l.offset + l.numel) << t.name;
    }
    next = l.offset + l.numel;
  }
  EXPECT_EQ(next, model.layout().numel());
  EXPECT_NE(model.layout().find("transformer.h.3.mlp.c_proj.weight"), nullptr);
  EXPECT_EQ(model.layout().find("lm_head.weight"), nullptr);  // tied to transformer.wte.weight
}

// A range of the initialisation equals the same elements of the whole model's: ranges that start
// and end mid-tensor, on odd elements (inside a Box–Muller pair), in padding, across tensors and
// layers — what ZeRO ranks draw for their owned slices instead of the whole model.
TEST(Presets, InitialisationOfAnyRangeEqualsTheWholeModels) {
  auto be = make_cpu_backend();
  GPT2Model model(gpt2_preset("gpt2-tiny"), *be);
  const ParamLayout& layout = model.layout();
  std::vector<float> whole(static_cast<size_t>(layout.numel()), 0.0f);
  model.init_parameters(whole.data(), 1234);
  const ParamTensor& wpe = *layout.find("transformer.wpe.weight");
  const ParamTensor& ln = *layout.find("transformer.h.0.ln_1.weight");
  const std::pair<int64_t, int64_t> ranges[] = {
      {0, layout.numel()},         {wpe.offset + 1, 7},
      {wpe.offset + 3, 1000},      {ln.offset - 5, 20},
      {layout.numel() - 333, 333}, {layout.numel() / 3 + 1, layout.numel() / 3}};
  for (const auto& [offset, numel] : ranges) {
    std::vector<float> part(static_cast<size_t>(numel), -1.0f);
    init_layout_range(layout, 1234, offset, numel, part.data());
    for (int64_t i = 0; i < numel; ++i)
      ASSERT_EQ(part[static_cast<size_t>(i)], whole[static_cast<size_t>(offset + i)])
          << "element " << offset + i << " of range [" << offset << ", " << offset + numel << ")";
  }
  std::vector<float> other(whole.size());
  init_layout_range(layout, 1235, 0, layout.numel(), other.data());
  EXPECT_NE(other, whole);  // the seed matters
}

TEST(Presets, UnknownNameSuggestsTheClosest) {
  try {
    gpt2_preset("gpt2-larg");
    FAIL() << "unknown preset accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean 'gpt2-large'"), std::string::npos)
        << e.what();
  }
}

// ---- pipeline building blocks (tests/stage_parts.h)
// ----------------------------------------------

TEST(StageParts, SplitBackwardEqualsFusedWithAnotherSlotInFlight) {
  auto be = make_cpu_backend();
  GPT2Config c = test_support::tiny_gpt2("split", 16);
  c.n_layer = 3;
  test_support::check_split_backward(*be, c, 2, 16);
}

TEST(StageParts, TwoPartsEqualTheWholeModel) {
  auto be = make_cpu_backend();
  GPT2Config c = test_support::tiny_gpt2("parts", 16);
  c.n_layer = 3;
  for (int cut = 1; cut <= 3; ++cut) test_support::check_stage_parts(*be, c, cut, 2, 16, 1e-6);
}

TEST(StageParts, LayerListsAreChecked) {
  auto be = make_cpu_backend();
  const GPT2Config c = test_support::tiny_gpt2("bad", 16);
  EXPECT_THROW(GPT2Model(c, *be, false, std::vector<int>{}), ConfigError);
  EXPECT_THROW(GPT2Model(c, *be, false, std::vector<int>{2, 1}), ConfigError);
  EXPECT_THROW(GPT2Model(c, *be, false, std::vector<int>{0, c.n_layer + 2}), ConfigError);
  GPT2Model last(c, *be, false, {c.n_layer, c.n_layer + 1});
  EXPECT_TRUE(last.has_head());
  EXPECT_FALSE(last.has_embedding());
  EXPECT_EQ(last.global_layer(0), c.n_layer);
  EXPECT_EQ(last.layout().find("transformer.wte.weight"), nullptr);  // read from a copy
}
