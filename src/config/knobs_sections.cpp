// The knobs of the smaller DeepSpeed sections, one row per key: the top level's batch sizes and
// single values, bf16 and fp16 (with fp16's loss scaling, LossScaleConfig) and aio (AioConfig).
// DeepSpeed's runtime/config.py, precision_config.py and runtime/swap_tensor/aio_config.py.
#include "config/knob.h"

namespace shardtrain {

const KnobTable& top_level_knobs() {
  static const KnobTable rows = {
      // ---- batch: validate() derives the sizes not given (DeepSpeed's batch identity) ----
      knob_at(&TrainConfig::micro_batch_size)
          .json_key("train_micro_batch_size_per_gpu")
          .train_flag("--batch-size", "N")
          .in_snapshot("micro_batch_size")
          .at_least(1)
          .on_json([](TrainConfig& c) { c.micro_batch_set = true; })
          .expects("an integer >= 1 (samples per device per micro-step)")
          .or_auto()
          .docs("micro-batch: samples per device per forward/backward pass (DeepSpeed "
                "train_micro_batch_size_per_gpu; default: {})"),
      knob_at(&TrainConfig::gradient_accumulation_steps)
          .json_key("gradient_accumulation_steps")
          .train_flag("--gradient-accumulation-steps", "N")
          .on_estimate()
          .in_snapshot("gradient_accumulation_steps")
          .at_least(1)
          .on_json([](TrainConfig& c) { c.accumulation_set = true; })
          .expects("an integer >= 1 (micro-steps per optimizer step)")
          .or_auto()
          .docs("micro-batches accumulated per optimizer step (default: {})"),
      knob_at(&TrainConfig::train_batch_size)
          .json_key("train_batch_size")
          .train_flag("--train-batch-size", "N")
          .on_estimate()
          .in_snapshot("train_batch_size")
          .at_least(1)
          .unset_is(0)
          .expects("an integer >= 1 (global batch in samples)")
          .or_auto()
          .shows_default("derived: micro-batch × accumulation × data-parallel degree")
          .docs("global batch in samples per optimizer step = batch-size x accumulation steps x "
                "data-parallel degree (the world size; with a pipeline, world size / "
                "pipeline stages); 0 derives it (DeepSpeed train_batch_size; default: {})"),
      // ---- length of training: shardtrain's flag (DeepSpeed counts steps in its scheduler) ----
      knob_at(&TrainConfig::max_steps)
          .train_flag("--max-steps", "N")
          .in_snapshot("max_steps")
          .at_least(1)
          .unset_is(-1)
          .expects("-1 (as many steps as --epochs allows) or a number of optimizer steps >= 1")
          .flag_parsed_by(minus_one_or_positive)
          .docs("stop after this many optimizer steps; -1 = as many as --epochs allows "
                "(default: {})"),
      // ---- single values ----
      knob_at(&TrainConfig::gradient_clipping)
          .json_key("gradient_clipping")
          .train_flag("--grad-clip", "NORM")
          .at_least(0)
          .in_snapshot("gradient_clipping")
          .expects("a number >= 0 (max global gradient L2 norm; 0 = off)")
          .shows_default("1.0 when omitted (DeepSpeed's default is 0, no clipping: write `0` for "
                         "that)")
          .docs("max global L2 norm of the gradients; 0 = no clipping (DeepSpeed "
                "gradient_clipping; default: {})"),
      knob_at(&TrainConfig::log_interval)
          .json_key("steps_per_print")
          .train_flag("--log-interval", "STEPS")
          .at_least(1)
          .expects("an integer >= 1 (steps between logs)")
          .docs("optimizer steps between log lines (DeepSpeed steps_per_print; default: {})"),
      knob_at(&TrainConfig::wall_clock_breakdown)
          .json_key("wall_clock_breakdown")
          .train_flag("--wall-clock-breakdown")
          .docs("time forward, backward, the wait for gradient reduction and the optimizer step "
                "on the device; log the means (ms per step) with each log line (DeepSpeed "
                "wall_clock_breakdown; default: off)"),
  };
  return rows;
}

namespace {

template <typename T>
Knob fp16(T LossScaleConfig::*m) {
  return knob_at(&TrainConfig::loss_scale, m);
}

template <typename T>
Knob aio(T AioConfig::*m) {
  return knob_at(&TrainConfig::aio, m);
}

}  // namespace

const KnobTable& fp16_knobs() {
  static const KnobTable rows = {
      // ---- bf16 (old name: bfloat16) ----
      Knob{}
          .json_key("bf16.enabled")
          .by_hand()  // the precision, with fp16.enabled (read_precision)
          .shows_default("false")
          .docs("`--precision bf16`; the section's old name `bfloat16` is accepted"),
      ignored_key("bf16.immediate_grad_update"),
      ignored_key("bf16.check_grad_overflow"),
      ignored_key("bf16.bf16_master_weights_and_grads"),
      ignored_key("bf16.bf16_optimizer_states"),
      // ---- fp16 ----
      Knob{}
          .json_key("fp16.enabled")
          .by_hand()  // the precision, with bf16.enabled (read_precision)
          .shows_default("false")
          .docs("`--precision fp16`; a section written `\"enabled\": false` (and bf16 absent or "
                "false): fp32"),
      fp16(&LossScaleConfig::loss_scale)
          .json_key("fp16.loss_scale")
          .at_least(0)
          .expects("a number >= 0 (0 = dynamic loss scaling)")
          .docs("0: dynamic; > 0: static scale"),
      fp16(&LossScaleConfig::initial_scale_power)
          .json_key("fp16.initial_scale_power")
          .at_least(0)
          .at_most(63)
          .expects("an integer in [0, 63] (initial dynamic scale 2^power)")
          .docs("the dynamic scale starts at 2^power"),
      fp16(&LossScaleConfig::loss_scale_window)
          .json_key("fp16.loss_scale_window")
          .at_least(1)
          .expects("an integer >= 1 (steps without overflow before the scale grows)")
          .docs("steps without overflow before the scale doubles"),
      fp16(&LossScaleConfig::hysteresis)
          .json_key("fp16.hysteresis")
          .at_least(1)
          .expects("an integer >= 1 (overflows tolerated before the scale shrinks)")
          .docs("overflows tolerated before the scale halves"),
      fp16(&LossScaleConfig::min_loss_scale)
          .json_key("fp16.min_loss_scale")
          .at_least(0, /*open=*/true)
          .expects("a number > 0")
          .docs("the dynamic scale never goes below it"),
      ignored_key("fp16.auto_cast"),
      ignored_key("fp16.consecutive_hysteresis"),
      ignored_key("fp16.fp16_master_weights_and_grads"),
      ignored_key("fp16.fused_mode"),
  };
  return rows;
}

const KnobTable& aio_knobs() {
  static const KnobTable rows = {
      aio(&AioConfig::block_size)
          .json_key("aio.block_size")
          .at_least(4096)
          .multiple_of(4096)
          .expects("a multiple of 4096 (O_DIRECT alignment), at least 4096: bytes per "
                   "read/write request, e.g. 1048576")
          .docs("bytes per read/write request (the last of a transfer may be shorter)"),
      aio(&AioConfig::queue_depth)
          .json_key("aio.queue_depth")
          .at_least(1)
          .expects("an integer >= 1 (most read/write requests in flight per file), e.g. 8")
          .docs("most requests in flight per swap file; min(thread_count, queue_depth) run at "
                "once"),
      aio(&AioConfig::thread_count)
          .json_key("aio.thread_count", {"intra_op_parallelism"})
          .at_least(1)
          .at_most(256)
          .expects("an integer in [1, 256] (I/O threads per file), e.g. 1")
          .docs("I/O threads per swap file; a transfer's requests are spread over them"),
      aio(&AioConfig::single_submit)
          .json_key("aio.single_submit")
          .docs("accepted; changes nothing here (every request is its own system call)"),
      aio(&AioConfig::overlap_events)
          .json_key("aio.overlap_events")
          .docs("accepted; changes nothing here (a thread starts the next request as soon as "
                "its previous one completes)"),
      ignored_key("aio.use_gds"),
  };
  return rows;
}

}  // namespace shardtrain
