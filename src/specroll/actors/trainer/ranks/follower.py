"""A trainer rank other than 0: hold its shards of the policy and do what rank 0 says, until ``Stop``.

Started like rank 0 (``python -m specroll.actors.trainer --config FILE`` with its rank on the
command line or in torchrun's environment, ``ranks.py``) but binds nothing and writes nothing to
``RUN_DIR``: it loads the same model, joins the process group, shards the model
(``sharded.py``) and then loops on rank 0's commands (``protocol/trainer_ranks.py``). Exit codes:
0 after ``Stop``; 1 a failure (logged in one line) — rank 0 gone included, which ends the wait for
its next command at once; 2 a bad config or rank (``cli.py``).
"""

from __future__ import annotations

import logging
from typing import assert_never

import torch
import torch.distributed as dist

from specroll.actors.config import RunConfig
from specroll.actors.shared.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from specroll.actors.trainer.ranks.channel import RankChannel
from specroll.actors.trainer.ranks.join import RankError, Ranks, join_group, rank_device
from specroll.actors.trainer.ranks.sharded import ShardedModel
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.trainer_ranks import GatherState, GatherWeights, Restore, Stop, TrainStep

log = logging.getLogger("specroll.trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_follower(config: RunConfig, ranks: Ranks) -> int:
    """Follow rank 0 until it says ``Stop``; return the exit code (module docstring)."""
    try:
        return _follow(config, ranks)
    except RankError as e:  # trainer.device = "cuda" without a device for this rank
        log.error("trainer rank %d: %s", ranks.rank, e)
        return EXIT_REFUSED
    except Exception as e:  # the rank's death: one line, the traceback at DEBUG
        log.error("trainer rank %d failed: %s: %s", ranks.rank, type(e).__name__, e)
        log.debug("traceback", exc_info=e)
        return EXIT_FAILED


def _follow(config: RunConfig, ranks: Ranks) -> int:
    tc = config.trainer
    device = rank_device(ranks, tc.device)
    if tc.train_threads is not None:
        torch.set_num_threads(tc.train_threads)
    dtype = DTYPES[config.model.dtype]
    ckpt = load_checkpoint(config.model.name, dtype)
    model = CausalLM(ckpt.config).to(dtype)
    model.load_weights(ckpt.weights)
    log.info("trainer rank %d of %d: joining %s", ranks.rank, ranks.world_size, ranks.init_method)
    store = join_group(ranks, device)
    sharded = ShardedModel(model, ranks, device, tc.learning_rate, tc.weight_decay, torch.get_num_threads())
    channel = RankChannel(store, ranks.rank, ranks.world_size, device)
    log.info("trainer rank %d of %d: %s shards on %s, following rank 0", ranks.rank, ranks.world_size,
             config.model.name, device)
    steps = 0
    while True:
        command = channel.receive()
        match command:
            case TrainStep():
                batch = channel.broadcast_batch(None, command.shape)
                sharded.train(batch, command.version, tc, command.threads)
                steps += 1
            case GatherWeights():
                sharded.gather_weights()
            case GatherState():
                sharded.gather_state()
            case Restore():
                sharded.restore(None, command.with_optimizer)
                log.info("trainer rank %d: restored the checkpoint of step %d", ranks.rank, command.step)
            case Stop():
                channel.acknowledge_stop()
                dist.destroy_process_group()
                log.info("trainer rank %d: stopped by rank 0 after %d steps", ranks.rank, steps)
                return EXIT_OK
            case _:
                assert_never(command)
