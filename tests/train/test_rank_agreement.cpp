// The record ranks compare before their first collective (train/rank_agreement.h): it holds what
// shapes the run and not where each node keeps its files, and a difference is named by key,
// value and ranks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <vector>

#include "config/config.h"
#include "test_support.h"
#include "train/rank_agreement.h"

using namespace shardtrain;

namespace {

TEST(RankAgreement, PathsMayDifferSettingsMayNot) {
  TrainConfig a;
  TrainConfig b = a;
  b.train_file = "/node2/copy/train.txt";
  b.data_dir = "/node2/data";
  b.monitor.tensorboard_dir = "/node2/tb";
  EXPECT_EQ(agreement_record(a, "shape"), agreement_record(b, "shape"));
  b.lr = 1e-3;
  EXPECT_NE(agreement_record(a, "shape"), agreement_record(b, "shape"));
  TrainConfig c = a;
  c.zero.offload_ratio = 0.5;
  EXPECT_NE(agreement_record(a, "shape"), agreement_record(c, "shape"));
  EXPECT_NE(agreement_record(a, "n_layer 2"), agreement_record(a, "n_layer 4"));
  // Every knob counts, by its JSON path: aio and loss scaling too; the swap file's directory
  // is a node's own.
  TrainConfig d = a;
  d.aio.queue_depth = 32;
  EXPECT_NE(agreement_record(a, "shape"), agreement_record(d, "shape"));
  EXPECT_TRUE(agreement_record(d, "shape").contains("aio.queue_depth"));
  d = a;
  d.loss_scale.hysteresis = 5;
  EXPECT_NE(agreement_record(a, "shape"), agreement_record(d, "shape"));
  d = a;
  d.zero.nvme_path = "/node2/nvme";
  EXPECT_EQ(agreement_record(a, "shape"), agreement_record(d, "shape"));
}

TEST(RankAgreement, TheMessageNamesKeysValuesAndRanks) {
  TrainConfig cfg;
  std::vector<nlohmann::json> records(4, agreement_record(cfg, "shape"));
  EXPECT_EQ(rank_disagreement(records), "");
  cfg.lr = 0.002;
  cfg.micro_batch_size = 16;
  records[2] = agreement_record(cfg, "shape");
  records[3] = agreement_record(cfg, "shape");
  const std::string m = rank_disagreement(records);
  EXPECT_CONTAINS(m, "the ranks were started with different settings");
  EXPECT_CONTAINS(m, "lr: 0.0006 on ranks 0, 1; 0.002 on ranks 2, 3");
  EXPECT_CONTAINS(m, "micro_batch_size: 16 on ranks 2, 3; 8 on ranks 0, 1");
}

}  // namespace
