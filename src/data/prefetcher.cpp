#include "data/prefetcher.h"

#include <utility>

namespace shardtrain {

Prefetcher::Prefetcher(Fill fill, bool threaded) : fill_(std::move(fill)) {
  if (threaded) worker_ = std::thread([this] { work(); });
}

Prefetcher::~Prefetcher() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

int Prefetcher::get(int64_t key, int64_t next) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  int slot;
  if (ready_key_ == key && key >= 0) {
    slot = ready_slot_;
    ++hits_;
  } else {
    slot = 1 - ready_slot_;  // not the slot the caller may still be reading
    lock.unlock();
    fill_(key, slot);
    lock.lock();
  }
  ready_key_ = -1;
  ready_slot_ = slot;
  if (next < 0 || !worker_.joinable()) return slot;  // unthreaded: every fill runs in get()
  job_key_ = next;
  job_slot_ = 1 - slot;
  busy_ = true;
  lock.unlock();
  cv_.notify_all();
  return slot;
}

void Prefetcher::work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || busy_; });
    if (!busy_) return;  // stopping and nothing left
    const int64_t key = job_key_;
    const int slot = job_slot_;
    lock.unlock();
    std::exception_ptr err;
    try {
      fill_(key, slot);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err)
      error_ = err;
    else {
      ready_key_ = key;
      ready_slot_ = slot;
    }
    busy_ = false;
    cv_.notify_all();
    if (stop_) return;
  }
}

}  // namespace shardtrain
