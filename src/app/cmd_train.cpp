// `shardtrain train`: flags (and an optional DeepSpeed JSON) → TrainConfig → train().
// The rank layout comes from the launcher's variables (comm/dist_env.h): the world size enters
// the config before it is validated (batch identity), and the communicator of the job is built
// from it (MPI on CPU, NCCL on GPU; docs/LAUNCHING.md).
#include <fmt/core.h>

#include <algorithm>
#include <filesystem>

#include "app/commands.h"
#include "app/error_report.h"
#include "backend/backend.h"
#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "comm/dist_env.h"
#include "config/knob.h"
#include "config/train_flags.h"
#include "core/strings.h"
#include "model/gpt2_config.h"
#include "model/image/image_zoo.h"
#include "train/image_trainer.h"
#include "train/trainer.h"

namespace shardtrain {
namespace {

/// The device the job's tensors live on, as make_backend() will pick it.
DeviceKind job_device(const std::string& device) {
  if (device == "cpu") return DeviceKind::kCPU;
  if (device == "cuda") return DeviceKind::kCUDA;
  return cuda_available() ? DeviceKind::kCUDA : DeviceKind::kCPU;
}

/// Throws ConfigError for a --model that is neither a GPT-2 preset, an image model nor a path,
/// suggesting the nearest name of either kind.
void check_model_name(const std::string& name) {
  if (name.empty() || is_image_model(name)) return;
  std::vector<std::string> names = gpt2_preset_names();
  for (const std::string& n : names)
    if (n == name) return;
  std::error_code ec;
  const bool looks_like_path = name.find('/') != std::string::npos ||
                               std::filesystem::path(name).extension() == ".json" ||
                               name.rfind('.', 0) == 0 || std::filesystem::exists(name, ec);
  if (looks_like_path) return;  // resolve_model() explains a missing file
  const std::vector<std::string>& images = image_model_names();
  names.insert(names.end(), images.begin(), images.end());
  throw ConfigError(fmt::format(
      "{} {}: unknown model{}: GPT-2 presets: {}; image models: {} (and ensemble:m1,m2,...); or "
      "the path of a Hugging Face style config.json",
      knob_for(&TrainConfig::model).name(), name, did_you_mean(name, names),
      join(gpt2_preset_names(), ", "), join(images, ", ")));
}

/// Runs `f`, which validates the configuration from the flags and the DeepSpeed JSON — the same
/// on every rank, so a ConfigError it throws is marked same_on_every_rank (rank 0 alone reports
/// it, app/error_report.h). Other errors pass unmarked.
template <typename F>
auto validating_configuration(F&& f) {
  try {
    return f();
  } catch (ConfigError& e) {
    e.mark_same_on_every_rank();
    throw;
  }
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto cfg = std::make_shared<TrainConfig>();
  auto comm_timeout = std::make_shared<double>(0);
  CLI::App* cmd = app.add_subcommand(
      "train", "train a GPT-2 model or an image classifier (see --help for the flags)");
  add_train_flags(*cmd, *cfg);
  cmd->footer(
      "Every flag and DeepSpeed JSON key (supported, ignored with a warning, or an error), their "
      "defaults and their DeepSpeed/PyTorch counterparts: docs/CONFIG.md. Errors and their fixes: "
      "docs/TROUBLESHOOTING.md.");
  cmd->add_option("--comm-timeout", *comm_timeout,
                  "seconds a collective may wait for the other ranks before the job stops with a "
                  "message naming them (default: $SHARDTRAIN_COMM_TIMEOUT or 300)")
      ->check(CLI::PositiveNumber);
  cmd->callback([cmd, cfg, comm_timeout]() {
    const DistributedEnv env = read_distributed_env();
    set_gpu_rank_environment(env, cfg->device);  // before the first CUDA call
    CommOptions options;
    options.timeout_s =
        validating_configuration([&] { return comm_timeout_seconds(*comm_timeout); });
    // A rank other than 0 holds its error back for this long (app/error_report.h): less than
    // rank 0 waits for it in a collective, so rank 0 cannot abort the job before it is printed.
    set_error_report_grace(std::min(5.0, options.timeout_s / 2));
    std::vector<std::string> warnings;
    // --resume without --model: the checkpoint's own shape (a custom one needs no config.json).
    // An image checkpoint names its model (the data set still comes from the flags).
    if (!cfg->resume.empty() && cmd->count(knob_for(&TrainConfig::model).name()) == 0) {
      cfg->model.clear();
      const CheckpointInfo info = read_checkpoint_info(cfg->resume);
      if (info.image) cfg->model = info.image->name;
    }
    const TrainConfig final_cfg = validating_configuration([&] {
      // The model's context bounds --max-length (image models: none); an unknown model name
      // fails here, clearly.
      check_model_name(cfg->model);
      const int64_t context =
          is_image_model(cfg->model) ? 0 : resolve_train_model(*cfg).n_positions;
      cfg->world_size = env.world_size;  // before validation: the batch identity needs it
      cfg->ranks_per_node = env.local_world_size;
      return finalize_train_config(*cmd, *cfg, context, warnings);
    });
    if (env.rank == 0)
      for (const auto& w : warnings) fmt::print(stderr, "warning: {}\n", w);
    auto comm = make_world_communicator(env, job_device(final_cfg.device), nullptr, options);
    if (is_image_model(final_cfg.model))
      train_image_model(final_cfg, *comm);
    else
      train(final_cfg, *comm);
    comm.reset();
    finalize_mpi(options.timeout_s);
  });
}

}  // namespace shardtrain
