#include "comm/scalar_all_reduce.h"

#include "core/error.h"

namespace shardtrain {

ScalarAllReduce::ScalarAllReduce(Backend& backend, Communicator& comm, int capacity)
    : backend_(backend), comm_(comm), capacity_(capacity) {
  ST_ASSERT(capacity >= 1);
  if (comm_.world_size() > 1) {
    buf_ = FlatBuffer(backend, DType::kF32, int64_t{2} * capacity * comm_.world_size());
    host_.resize(static_cast<size_t>(buf_.numel()));
  }
}

std::vector<double> ScalarAllReduce::gather(std::span<const double> values) {
  const int world = comm_.world_size();
  if (world == 1) return {values.begin(), values.end()};
  const int64_t n = static_cast<int64_t>(values.size());
  ST_ASSERT(n <= capacity_);
  const int64_t words = 2 * n;
  for (int64_t i = 0; i < n; ++i) {
    const double v = values[static_cast<size_t>(i)];
    const float hi = static_cast<float>(v);
    host_[static_cast<size_t>(2 * i)] = hi;
    host_[static_cast<size_t>(2 * i + 1)] = static_cast<float>(v - static_cast<double>(hi));
  }
  const Tensor own = buf_.slice(comm_.rank() * words, words);
  backend_.copy_from_host(own.data, host_.data(), own.bytes());
  // In place: this rank's words are its slice of the output.
  comm_.all_gather(buf_.slice(0, world * words), own)->wait();
  backend_.copy_to_host(host_.data(), buf_.data(),
                        static_cast<size_t>(world * words) * sizeof(float));
  std::vector<double> out(static_cast<size_t>(world * n));
  for (int64_t k = 0; k < world * n; ++k)
    out[static_cast<size_t>(k)] = static_cast<double>(host_[static_cast<size_t>(2 * k)]) +
                                  static_cast<double>(host_[static_cast<size_t>(2 * k + 1)]);
  return out;
}

void ScalarAllReduce::sum(std::span<double> values) {
  const int world = comm_.world_size();
  if (world == 1) return;
  const std::vector<double> all = gather(values);
  const size_t n = values.size();
  for (size_t i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < world; ++r) s += all[static_cast<size_t>(r) * n + i];
    values[i] = s;
  }
}

}  // namespace shardtrain
