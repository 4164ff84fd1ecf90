#include <cstring>

#include "comm/communicator.h"
#include "core/error.h"

namespace shardtrain {
namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool completed() override { return true; }
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend_name() const override { return "local"; }
  std::unique_ptr<Work> all_reduce(Tensor, ReduceOp) override { return done(); }
  std::unique_ptr<Work> reduce_scatter(Tensor output, Tensor input, ReduceOp) override {
    ST_ASSERT(output.bytes() == input.bytes());
    if (output.data != input.data) std::memmove(output.data, input.data, input.bytes());
    return done();
  }
  std::unique_ptr<Work> all_gather(Tensor output, Tensor input) override {
    ST_ASSERT(output.bytes() == input.bytes());
    if (output.data != input.data) std::memmove(output.data, input.data, input.bytes());
    return done();
  }
  std::unique_ptr<Work> all_to_all(Tensor output, Tensor input) override {
    ST_ASSERT(output.bytes() == input.bytes());
    std::memmove(output.data, input.data, input.bytes());
    return done();
  }
  std::unique_ptr<Work> broadcast(Tensor, int root) override {
    check<ConfigError>(root == 0, "broadcast root {} is outside a group of one rank", root);
    return done();
  }
  std::unique_ptr<Work> send(Tensor, int peer) override {
    throw ConfigError(fmt::format("send to rank {}: this run has a single rank", peer));
  }
  std::unique_ptr<Work> recv(Tensor, int peer) override {
    throw ConfigError(fmt::format("recv from rank {}: this run has a single rank", peer));
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(const std::vector<int>& ranks) override {
    check<ConfigError>(ranks.size() == 1 && ranks[0] == 0,
                       "cannot form a group of {} ranks from a single-rank run", ranks.size());
    return std::make_unique<LocalCommunicator>();
  }

 private:
  static std::unique_ptr<Work> done() { return std::make_unique<DoneWork>(); }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace shardtrain
