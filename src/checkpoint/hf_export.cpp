#include "checkpoint/hf_export.h"

#include <fmt/core.h>

#include "backend/backend.h"
#include "checkpoint/sharded_checkpoint.h"
#include "core/error.h"
#include "model/gpt2.h"

namespace shardtrain {
namespace fs = std::filesystem;

void export_hf_model(const CheckpointInfo& info, const fs::path& out_dir,
                     const fs::path& tokenizer_dir, HfDtype dtype) {
  require_gpt2_checkpoint(info, "the Hugging Face GPT-2 export");
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec)
    throw RuntimeFailure(
        fmt::format("cannot create export directory {}: {}", out_dir.string(), ec.message()));
  auto backend = make_cpu_backend();  // the model's layout only: nothing is allocated
  const GPT2Model model(info.model, *backend);
  const ParamLayout& layout = model.layout();
  const fs::path tmp = out_dir / "model.safetensors.partial";
  {
    HfWeightsWriter writer(tmp, layout, dtype);
    for_each_param_tensor(info, layout,
                          [&](const ParamTensor& t, const float* data) { writer.write(t, data); });
    writer.finish();
  }
  fs::rename(tmp, out_dir / "model.safetensors", ec);
  if (ec) throw RuntimeFailure(fmt::format("cannot rename {}: {}", tmp.string(), ec.message()));
  save_hf_config(out_dir, info.model);
  const auto copy = [&](const fs::path& from, const fs::path& to) {
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec)
      throw RuntimeFailure(
          fmt::format("cannot copy {} to {}: {}", from.string(), to.string(), ec.message()));
  };
  copy(tokenizer_dir / "encoder.json", out_dir / "vocab.json");
  copy(tokenizer_dir / "vocab.bpe", out_dir / "merges.txt");
}

}  // namespace shardtrain
