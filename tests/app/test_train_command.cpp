// What `launch` reads in, and changes in, the train command it starts (app/train_command.h).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "app/train_command.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace {

TEST(TrainCommand, DeviceFlag) {
  namespace st = shardtrain;
  EXPECT_EQ(st::device_flag({"train", "--device", "cpu"}), "cpu");
  EXPECT_EQ(st::device_flag({"train", "--device=cuda"}), "cuda");
  EXPECT_EQ(st::device_flag({"train"}), "auto");
}

TEST(TrainCommand, RestartCommandResumesTrainFromItsOutputDirectory) {
  namespace st = shardtrain;
  const fs::path dir = shardtrain::test_support::make_temp_dir("shardtrain_restart_command");
  const std::vector<std::string> cmd = {"train", "--output-dir", (dir / "o").string(), "--resume",
                                        "elsewhere"};
  std::string why;
  EXPECT_EQ(st::restart_command(cmd, &why), cmd) << "no checkpoint yet: the same command";
  EXPECT_NE(why.find("from the start"), std::string::npos) << why;
  fs::create_directories(dir / "o");
  std::ofstream(dir / "o" / "latest") << "checkpoint-000002\n";
  const std::vector<std::string> want = {"train", "--output-dir", (dir / "o").string(), "--resume",
                                         (dir / "o").string()};
  EXPECT_EQ(st::restart_command(cmd, &why), want);
  const std::vector<std::string> other = {"generate", "--output-dir", (dir / "o").string()};
  EXPECT_EQ(st::restart_command(other), other);
  fs::remove_all(dir);
}

}  // namespace
