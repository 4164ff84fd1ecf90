// TensorBoard event files and the CSV monitor (monitor/tensorboard.h, monitor/monitor.h): written,
// then read back with our own TFRecord reader (CRCs checked) and the generated protobuf classes.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "monitor/metrics.h"
#include "monitor/monitor.h"
#include "monitor/tensorboard.h"
#include "monitor/tensorboard_event.pb.h"
#include "test_support.h"

namespace shardtrain {
namespace {
namespace fs = std::filesystem;
namespace tb = shardtrain::tensorboard;
using test_support::make_temp_dir;

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) files.push_back(e.path());
  return files;
}

std::vector<tb::Event> read_events(const fs::path& file) {
  std::vector<tb::Event> events;
  for (const std::string& rec : read_tfrecords(file)) {
    tb::Event ev;
    EXPECT_TRUE(ev.ParseFromString(rec));
    events.push_back(ev);
  }
  return events;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Crc32c, KnownValues) {
  // RFC 3720 B.4 and the common check value of CRC-32C.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  const std::string ones(32, '\xff');
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // Incremental = one pass.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
  // masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfRecord, FrameLayoutAndCorruptionIsDetected) {
  const fs::path dir = make_temp_dir("shardtrain_test_tfrecord");
  const std::string framed = tfrecord_frame("hello");
  ASSERT_EQ(framed.size(), 8u + 4u + 5u + 4u);
  EXPECT_EQ(static_cast<unsigned char>(framed[0]), 5);  // little-endian length
  for (int i = 1; i < 8; ++i) EXPECT_EQ(framed[static_cast<size_t>(i)], '\0');
  EXPECT_EQ(framed.substr(12, 5), "hello");
  const fs::path file = dir / "r.tfrecord";
  {
    std::ofstream out(file, std::ios::binary);
    out << framed << tfrecord_frame("") << tfrecord_frame(std::string(1000, 'x'));
  }
  const auto recs = read_tfrecords(file);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0], "hello");
  EXPECT_EQ(recs[1], "");
  EXPECT_EQ(recs[2], std::string(1000, 'x'));
  {
    std::string bad = framed;
    bad[13] ^= 1;  // a data byte
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << bad;
  }
  EXPECT_THROW(read_tfrecords(file), RuntimeFailure);
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << framed.substr(0, 15);  // truncated
  }
  EXPECT_THROW(read_tfrecords(file), RuntimeFailure);
  fs::remove_all(dir);
}

TEST(TensorBoardWriter, EventsReadBackWithTheirValues) {
  const fs::path dir = make_temp_dir("shardtrain_test_tensorboard") / "run";
  fs::path path;
  {
    TensorBoardWriter w(dir);
    path = w.path();
    w.add_text("config", "    {\"model\": \"gpt2-tiny\"}", 0);
    w.add_scalar("train/loss", 10.8125, 1);
    w.add_scalar("train/loss", 9.5, 2);
    w.add_scalar("train/lr", 3e-4, 2);
  }
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], path);
  const std::string name = path.filename().string();
  EXPECT_TRUE(name.ends_with(".v2")) << name;
  EXPECT_TRUE(name.find(fmt::format(".{}.v2", ::getpid())) != std::string::npos) << name;

  const auto events = read_events(path);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_GT(events[0].wall_time(), 1.6e9);

  const tb::Summary::Value& text = events[1].summary().value(0);
  EXPECT_EQ(text.tag(), "config");
  EXPECT_EQ(text.metadata().plugin_data().plugin_name(), "text");
  EXPECT_EQ(text.tensor().dtype(), tb::DT_STRING);
  ASSERT_EQ(text.tensor().string_val_size(), 1);
  EXPECT_EQ(text.tensor().string_val(0), "    {\"model\": \"gpt2-tiny\"}");

  struct Want {
    const char* tag;
    int64_t step;
    float value;
  };
  const Want want[] = {
      {"train/loss", 1, 10.8125f}, {"train/loss", 2, 9.5f}, {"train/lr", 2, 3e-4f}};
  for (size_t i = 0; i < 3; ++i) {
    const tb::Event& ev = events[i + 2];
    EXPECT_EQ(ev.step(), want[i].step);
    ASSERT_EQ(ev.summary().value_size(), 1);
    EXPECT_EQ(ev.summary().value(0).tag(), want[i].tag);
    EXPECT_TRUE(ev.summary().value(0).has_simple_value());
    EXPECT_EQ(ev.summary().value(0).simple_value(), want[i].value);
    EXPECT_GE(ev.wall_time(), events[0].wall_time());
  }
  fs::remove_all(dir.parent_path());
}

// A resumed run's Monitor writes a SessionLog START at the step it continues from (TensorFlow's
// event.proto field 7, status 1): TensorBoard then drops what earlier event files of the
// directory logged from that step on.
TEST(TensorBoardWriter, SessionStartMarksWhereAResumedRunContinues) {
  const fs::path dir = make_temp_dir("shardtrain_test_tensorboard_resume") / "run";
  MonitorConfig cfg;
  cfg.tensorboard_dir = dir.string();
  {
    Monitor m(cfg, 0);
    m.restart_at(5);
    m.scalar("train/loss", 7.25, 5);
  }
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  const auto events = read_events(files[0]);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_TRUE(events[1].has_session_log());
  EXPECT_EQ(events[1].session_log().status(), tb::SessionLog::START);
  EXPECT_EQ(events[1].step(), 5);
  EXPECT_EQ(events[2].summary().value(0).tag(), "train/loss");
  // On the wire: field 7 (session_log), length-delimited, holding field 1 (status) = 1.
  tb::Event only;
  only.set_step(5);
  only.mutable_session_log()->set_status(tb::SessionLog::START);
  EXPECT_NE(only.SerializeAsString().find(std::string("\x3a\x02\x08\x01", 4)), std::string::npos);
  fs::remove_all(dir.parent_path());
}

// metrics.jsonl of a run resumed from a checkpoint of step 2: the records logged before the first
// one of step 3 stay (an epoch summary and a validation of step 2 among them), the rest go — the
// later steps, the summary after them, a line a crash cut short.
TEST(MetricsFile, KeepThroughAStepDropsWhatCameLater) {
  const fs::path dir = make_temp_dir("shardtrain_test_metrics_keep");
  const fs::path file = dir / "metrics.jsonl";
  {
    std::ofstream out(file);
    out << R"({"step": 1, "loss": 9.5})"
        << "\n"
        << R"({"step": 2, "loss": 9.0})"
        << "\n"
        << R"({"epoch": 1, "tokens_per_s": 100})"
        << "\n"
        << R"({"step": 2, "val_loss": 8.5})"
        << "\n"
        << R"({"step": 3, "loss": 8.0})"
        << "\n"
        << R"({"epoch": 2, "tokens_per_s": 100})"
        << "\n"
        << R"({"step": 4, "lo)";
  }
  keep_metrics_through(file, 2);
  EXPECT_EQ(slurp(file), std::string(R"({"step": 1, "loss": 9.5})") + "\n" +
                             R"({"step": 2, "loss": 9.0})" + "\n" +
                             R"({"epoch": 1, "tokens_per_s": 100})" + "\n" +
                             R"({"step": 2, "val_loss": 8.5})" + "\n");
  keep_metrics_through(dir / "absent.jsonl", 2);  // nothing to do
  EXPECT_FALSE(fs::exists(dir / "absent.jsonl"));
  fs::remove_all(dir);
}

TEST(CsvMonitor, OneFilePerTagWithStepAndValue) {
  const fs::path dir = make_temp_dir("shardtrain_test_csv") / "job";
  {
    CsvMonitor csv(dir);
    csv.add_scalar("train/loss", 10.5, 1);
    csv.add_scalar("train/loss", 0.1, 2);
    csv.add_scalar("val/perplexity", 12345.678, 2);
  }
  EXPECT_EQ(CsvMonitor::file_of(dir, "train/loss"), dir / "train_loss.csv");
  EXPECT_EQ(slurp(dir / "train_loss.csv"), "step,loss\n1,10.5\n2,0.1\n");
  EXPECT_EQ(slurp(dir / "val_perplexity.csv"), "step,perplexity\n2,12345.678\n");
  {  // A second run appends, without a second header.
    CsvMonitor csv(dir);
    csv.add_scalar("train/loss", 9, 3);
  }
  EXPECT_EQ(slurp(dir / "train_loss.csv"), "step,loss\n1,10.5\n2,0.1\n3,9\n");
  fs::remove_all(dir.parent_path());
}

TEST(Monitor, RanksAndFanOut) {
  const fs::path root = make_temp_dir("shardtrain_test_monitor");
  MonitorConfig cfg;
  cfg.tensorboard_dir = (root / "tb").string();
  cfg.csv_dir = (root / "csv").string();
  {
    Monitor m(cfg, 0, "config text");
    ASSERT_TRUE(m.active());
    m.scalar("train/loss", 2.5, 7);
    Monitor other(cfg, 1);  // rank 1 writes nothing by default
    EXPECT_FALSE(other.active());
    Monitor off;
    EXPECT_FALSE(off.active());
    off.scalar("train/loss", 1, 1);  // no-op
  }
  ASSERT_EQ(event_files(root / "tb").size(), 1u);
  const auto events = read_events(event_files(root / "tb")[0]);
  ASSERT_EQ(events.size(), 3u);  // version, config, loss
  EXPECT_EQ(events[2].summary().value(0).simple_value(), 2.5f);
  EXPECT_EQ(slurp(root / "csv" / "train_loss.csv"), "step,loss\n7,2.5\n");

  cfg.tensorboard_all_ranks = true;
  cfg.tensorboard_dir = (root / "all").string();
  {
    Monitor r0(cfg, 0), r1(cfg, 1);
    EXPECT_TRUE(r1.active());
    r1.scalar("train/loss", 1.25, 1);
  }
  EXPECT_EQ(event_files(root / "all" / "rank-0").size(), 1u);
  ASSERT_EQ(event_files(root / "all" / "rank-1").size(), 1u);
  EXPECT_EQ(read_events(event_files(root / "all" / "rank-1")[0]).size(), 2u);
  fs::remove_all(root);
}

}  // namespace
}  // namespace shardtrain
