"""Typed configs of the post-training stages: each is a `PosttrainConfig` — the runtime's
`TrainConfig` plus the policy checkpoint, its chat template, LoRA and the held-out task
evaluation — and its own data and loss fields. Defaults run the tiny CPU setting on the
README run's base checkpoint and the embedded arithmetic task."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lathe.core.errors import ConfigError
from lathe.data.chat_template import TEMPLATE_ARGUMENTS
from lathe.data.mixture import WeightedSource
from lathe.model.lora import LoraSection
from lathe.pretrain.runtime.config import TrainConfig
from lathe.serve.tool_calls import PARSERS

TASK_EVAL_EXAMPLES = 64  # held-out prompts when the stage trains on lathe's tasks


@dataclass
class TaskEvalConfig:
    """Accuracy by generation (greedy, the serve engine) on a held-out prompt set."""

    prompts: str = "task:arithmetic"  # task:NAME (its test split) or a prompt .jsonl
    task: str = "arithmetic"  # the verifier: arithmetic | arithmetic3 | arithmetic3x3 | stdlib_qa
    # 0 turns it off; unset: 64 when the stage trains on lathe's tasks (task:NAME), off when
    # it trains on your own data, which lathe's arithmetic says nothing about
    examples: int | None = None
    max_tokens: int = 12
    # stop training once held-out accuracy reaches this (Lightning's stopping_threshold),
    # e.g. to hand a partly-trained SFT model to RL; checked at every evaluation
    stop_at: float | None = None
    # on reaching stop_at, train this many steps more with the learning rate falling
    # linearly to schedule.min_lr_ratio (WSD's decay, begun by the metric), then stop: a
    # model caught mid-climb settles before it is handed on; 0 stops at once
    cooldown_steps: int = 0

    def __post_init__(self) -> None:
        if self.examples is not None and self.examples < 0:
            raise ConfigError(f"task_eval.examples={self.examples}: a count of held-out "
                              "prompts, or 0 to turn the evaluation off")
        if self.stop_at is not None and not 0 < self.stop_at <= 1:
            raise ConfigError(f"task_eval.stop_at={self.stop_at}: an accuracy in (0, 1], "
                              "or null to train for max_steps")
        if self.cooldown_steps < 0:
            raise ConfigError(f"task_eval.cooldown_steps={self.cooldown_steps}: a number of "
                              "steps after stop_at is reached, or 0 to stop at once")
        if self.cooldown_steps and self.stop_at is None:
            raise ConfigError(f"task_eval.cooldown_steps={self.cooldown_steps} begins when "
                              "task_eval.stop_at is reached; set stop_at, or cooldown_steps 0")


@dataclass
class ToolsConfig:
    """Tools a stage's generations may call (GRPO's rollouts, the held-out evaluation):
    after each assistant turn its calls are parsed, run (`lathe.data.tool_runner`) and
    answered with tool messages, and generation goes on until a reply without calls."""

    # registered names (calculator) or package.module:function; empty: no tools
    names: list[str] = field(default_factory=list)
    # how the model writes calls (lathe.serve.tool_calls.PARSERS); "": its chat template's way
    parser: str = ""
    max_tool_turns: int = 2  # assistant turns that may call tools; the next must answer
    seconds: float = 5.0  # a call's time limit
    max_chars: int = 4096  # a call's output limit

    def __post_init__(self) -> None:
        if self.parser not in ("", *PARSERS):
            raise ConfigError(f"tools.parser={self.parser!r}: choose one of {', '.join(PARSERS)} "
                              "(or leave it empty for the chat template's format)")
        for name in ("max_tool_turns", "seconds", "max_chars"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"tools.{name}={getattr(self, name)} must be positive")


@dataclass
class PosttrainConfig(TrainConfig):
    """What every post-training stage has: the policy checkpoint it starts from, the chat
    template it trains and evaluates through, LoRA, and the held-out task evaluation."""

    model: str = "runs/e2e/pretrain/final"
    # a Jinja file replacing the checkpoint's chat template for this stage (exported with
    # the model), e.g. one with {% generation %} blocks where the checkpoint's gives no mask
    chat_template: str | None = None
    # extra template variables, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    lora: LoraSection = field(default_factory=LoraSection)
    task_eval: TaskEvalConfig = field(default_factory=TaskEvalConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    # a mixture of experts: the weight of its router's balance loss in the stage's loss
    # (TRL's router_aux_loss_coef); null: the checkpoint's own router_aux_loss_coef where
    # TRL's trainer adds it (SFT, DPO and its variants, GRPO), none for distillation (TRL's
    # GKD adds none) or a reward model (which takes none); 0: off
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        coef = self.router_aux_loss_coef
        if coef is not None and not (0 <= coef < math.inf):
            raise ConfigError(f"router_aux_loss_coef={coef} must be a number >= 0 (0: off; "
                              "null: the checkpoint's own)")
        for key in self.chat_template_kwargs:
            if key in TEMPLATE_ARGUMENTS:
                raise ConfigError(f"chat_template_kwargs.{key}: lathe sets {key!r} itself; "
                                  "remove it")
        if self.task_eval.examples is None:
            own = [s for s in self.training_sources() if not s.startswith("task:")]
            self.task_eval.examples = 0 if own else TASK_EVAL_EXAMPLES
        if self.task_eval.stop_at is not None and not self.task_eval.examples:
            raise ConfigError(f"task_eval.stop_at={self.task_eval.stop_at} needs the held-out "
                              "evaluation: set task_eval.examples (it is off on your own data)")

    def training_sources(self) -> list[str]:
        """The sources the stage trains on (task:NAME, files, hf:NAME)."""
        raise NotImplementedError

    def balances_by_default(self) -> bool:
        """Whether router_aux_loss_coef=null adds the checkpoint's own balance loss (TRL's
        SFT, DPO and GRPO trainers do)."""
        return True


@dataclass
class ChatDataConfig:
    # a chat .jsonl, hf:NAME[:SPLIT] or task:NAME; or a weighted mixture of them, a list of
    # {source, weight} (lathe.data.mixture: proportions exact, the set seeded by `seed`)
    train: str | list[WeightedSource] = "task:arithmetic"
    eval: str | list[WeightedSource] | None = None  # held-out chats; default: train's test split
    limit: int | None = None  # chats to train on (a mixture's total)
    max_len: int = 128  # longer conversations are cut (their tail loses supervision)
    # pack chats into rows of max_len tokens, each attending only to itself
    # (lathe.posttrain.packing), instead of padding each to the longest of its micro-batch;
    # micro_batch_size then counts rows
    packing: bool = False


@dataclass
class ChatStageConfig(PosttrainConfig):
    """A stage that trains on chats: SFT and distillation."""

    data: ChatDataConfig = field(default_factory=ChatDataConfig)

    def training_sources(self) -> list[str]:
        train = self.data.train
        return [train] if isinstance(train, str) else [part.source for part in train]


@dataclass
class SFTConfig(ChatStageConfig):
    out_dir: str = "runs/sft"


@dataclass
class RewardSpec:
    """A reward: a function from the registry (`lathe.posttrain.rewards.REWARDS`) or
    `module:function` (`name`), or a reward model's score (`model`: a checkpoint `lathe rm`
    wrote, or any family's `…ForSequenceClassification` of one label)."""

    name: str | None = None
    model: str | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if (self.name is None) == (self.model is None):
            raise ConfigError(f"rewards: {{name: {self.name}, model: {self.model}}}: give a "
                              "reward function's name or a reward model's path, one of them")


@dataclass
class DistillConfig(ChatStageConfig):
    """Distillation of `teacher` into the student `model` (they share a tokenizer).
    logits: the student matches the teacher's next-token distributions on the chat data's
    assistant tokens; teacher_data: SFT on the teacher's greedy answers to the data's prompts;
    on_policy: the student samples answers to the data's prompts and matches the teacher's
    distributions on its own tokens (GKD, Agarwal et al. 2024, as TRL's DistillationTrainer)."""

    out_dir: str = "runs/distill"
    model: str = "runs/student"  # the student checkpoint
    teacher: str = "runs/grpo/final"
    mode: Literal["logits", "teacher_data", "on_policy"] = "logits"
    # forward_kl is KL(teacher ‖ student), reverse_kl KL(student ‖ teacher) (TRL's beta=1,
    # its default on-policy), jsd the generalized JSD at jsd_beta (TRL's beta)
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    jsd_beta: float = 0.5  # interpolation of the generalized JSD (0.5: symmetric)
    temperature: float = 1.0  # of both distributions, and on_policy of the student's sampling
    # loss = ce_weight · CE + (1 − ce_weight) · KD; unset: 0.5, and 0 on_policy, whose
    # samples are the student's own and no target to imitate
    ce_weight: float | None = None
    max_completion_tokens: int = 32  # the teacher's answers or (on_policy) the student's
    top_p: float = 1.0  # on_policy: the student's sampling
    # on_policy: the samples also scored by `rewards` and learnt from by REINFORCE (the
    # step's mean reward as baseline), weighted reward_weight beside the divergence (GKD's
    # mix of distillation and RL)
    rewards: list[RewardSpec] = field(default_factory=list)
    reward_weight: float = 0.0

    def balances_by_default(self) -> bool:
        """Teacher-generated data trains as SFT does; the divergences, as TRL's GKD, add no
        balance loss unless router_aux_loss_coef asks."""
        return self.mode == "teacher_data"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ce_weight is None:
            self.ce_weight = 0.0 if self.mode == "on_policy" else 0.5
        if not 0 <= self.ce_weight <= 1:
            raise ConfigError(f"ce_weight={self.ce_weight} must be in [0, 1]")
        if self.mode == "on_policy" and self.ce_weight:
            raise ConfigError(f"ce_weight={self.ce_weight} with mode=on_policy: the student's "
                              "own samples are no target to imitate; set ce_weight=0")
        if not 0 < self.jsd_beta < 1:
            raise ConfigError(f"jsd_beta={self.jsd_beta} must be in (0, 1)")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be positive")
        if self.reward_weight < 0 or bool(self.reward_weight) != bool(self.rewards) or (
                self.rewards and self.mode != "on_policy"):
            raise ConfigError(f"reward_weight={self.reward_weight} with {len(self.rewards)} "
                              "rewards: a reward mixes into mode=on_policy only, with both a "
                              "positive reward_weight and at least one reward")
        if self.max_completion_tokens < 1 or not 0 < self.top_p <= 1:
            raise ConfigError(f"max_completion_tokens={self.max_completion_tokens}, top_p="
                              f"{self.top_p}: give a positive token count and 0 < top_p <= 1")


Overflow = Literal["drop", "truncate_left"]


@dataclass
class PreferenceDataConfig:
    train: str = "task:arithmetic"
    eval: str | None = None
    limit: int | None = None
    max_len: int = 128  # prompt + reply; replies are cut to fit
    max_prompt_length: int | None = None  # default: max_len // 2
    prompt_overflow: Overflow = "drop"  # or truncate_left (keeps the question's end)


@dataclass
class DPOConfig(PosttrainConfig):
    out_dir: str = "runs/dpo"
    model: str = "runs/sft/final"
    reference: str | None = None  # default: the starting policy (or the base under LoRA)
    beta: float = 0.1
    # sigmoid (DPO), ipo: against the reference; simpo, orpo: the policy alone, no reference
    # kto: unpaired labelled completions (`lathe.posttrain.kto`) against the reference
    loss: Literal["sigmoid", "ipo", "simpo", "orpo", "kto"] = "sigmoid"
    simpo_gamma: float = 0.5  # SimPO's target reward margin γ (TRL's default)
    # KTO's weights of desirable and undesirable completions' losses (TRL's defaults); set
    # them so desirable_weight × desirables / (undesirable_weight × undesirables) is 1-4/3
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # weight of the chosen replies' NLL added to the loss (TRL's RPO; CPO's cpo_alpha)
    rpo_alpha: float = 0.0
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ConfigError(f"beta={self.beta} must be positive (TRL's default is 0.1)")
        if self.rpo_alpha < 0:
            raise ConfigError(f"rpo_alpha={self.rpo_alpha} must be >= 0 (0: plain DPO; TRL "
                              "suggests 1.0)")
        if self.simpo_gamma < 0:
            raise ConfigError(f"simpo_gamma={self.simpo_gamma} must be >= 0 (TRL's default "
                              "is 0.5)")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive (TRL's "
                                  "default is 1.0)")
        if self.loss == "kto" and self.rpo_alpha:
            raise ConfigError(f"rpo_alpha={self.rpo_alpha} with loss=kto: KTO's completions are "
                              "not all desirable, so there is no chosen NLL; leave it at 0")
        if self.loss == "orpo" and self.rpo_alpha:
            raise ConfigError(f"rpo_alpha={self.rpo_alpha} with loss=orpo: ORPO already "
                              "trains the chosen sequences' NLL; leave rpo_alpha at 0")
        if self.loss in ("simpo", "orpo") and self.reference is not None:
            raise ConfigError(f"reference={self.reference!r} with loss={self.loss}, which "
                              "uses no reference model; drop reference")

    def training_sources(self) -> list[str]:
        return [self.data.train]


@dataclass
class RMConfig(PosttrainConfig):
    """Reward modelling: a sequence classifier of one label started from `model` (a
    language model's decoder and a new score head, or a reward model to train on), trained
    on preference pairs with TRL's RewardTrainer loss."""

    out_dir: str = "runs/rm"
    model: str = "runs/sft/final"
    # adds coefficient × mean (r_chosen + r_rejected)², centring the rewards on 0 (TRL's
    # center_rewards_coefficient; Eisenstein et al. suggest 0.01); null: off
    center_rewards_coefficient: float | None = None
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lora.qlora:
            raise ConfigError("lora.qlora=true: a reward model's LoRA trains on a "
                              "full-precision decoder here; set lora.qlora=false")
        if "lm_head" in self.lora.target_modules:
            raise ConfigError("lora.target_modules has lm_head: a reward model has no LM head "
                              "(its score head trains whole); drop it")
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient={coefficient} must be >= 0 (or null)")
        if self.router_aux_loss_coef:
            raise ConfigError(f"router_aux_loss_coef={self.router_aux_loss_coef}: a reward "
                              "model's loss has no balance term (nor has TRL's "
                              "RewardTrainer's); drop it")

    def balances_by_default(self) -> bool:
        return False

    def training_sources(self) -> list[str]:
        return [self.data.train]


@dataclass
class RolloutConfig:
    """Where GRPO's rollouts are sampled: each rank's own engine (url unset), or the
    OpenAI-compatible server at `url` — lathe serve started with --api-key and
    --weights-root, or any server that takes POST /update_weights — to which the trainer
    pushes each step's weights under `weights_dir` (a folder the server reads: inside its
    --weights-root, on a filesystem both see). Its API key comes from the environment
    variable named by `api_key_env`, never from a recipe. `url: local` starts lathe serve on
    the policy in a process of its own for the run (pushes under out_dir/rollout-weights
    unless `weights_dir` says otherwise), with the in-process engine's KV cache and, off
    CUDA, its eager steps."""

    url: str | None = None
    weights_dir: str | None = None
    api_key_env: str = "LATHE_ROLLOUT_API_KEY"
    model: str | None = None  # the served model's name (default: the server's first)
    timeout: float = 600.0  # seconds a request may take
    concurrency: int = 64  # requests in flight at once, per rank
    # a request that fails on the way, or that a busy or restarting server answers with 408,
    # 409, 429 or 5xx, is sent again after a backoff (0.5 s doubling to 8 s) this many times
    max_retries: int = 5
    # 0: synchronous (sample, train, push); 1: the next step's rollouts are sampled while this
    # step trains, by the weights the server holds then — one step old (asynchronous GRPO;
    # it needs sampling_correction to correct the gap; dynamic sampling's further rounds are
    # drawn when the step asks, by the current weights). Needs url.
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError(f"rollout.max_retries={self.max_retries} must be >= 0")
        if self.max_staleness not in (0, 1):
            raise ConfigError(f"rollout.max_staleness={self.max_staleness}: 0 (synchronous) or "
                              "1 (the next step sampled while this one trains)")
        if self.max_staleness and self.url is None:
            raise ConfigError("rollout.max_staleness=1 samples on an engine in its own process "
                              "while the trainer trains: give rollout.url (a lathe serve with "
                              "--api-key and --weights-root, or local to start one)")
        if self.url not in (None, "local") and self.weights_dir is None:
            raise ConfigError(f"rollout.url={self.url!r} needs rollout.weights_dir: a folder "
                              "inside the server's --weights-root the trainer writes its "
                              "weights to each step")
        if self.timeout <= 0 or self.concurrency < 1:
            raise ConfigError(f"rollout.timeout={self.timeout}, rollout.concurrency="
                              f"{self.concurrency}: both must be positive")


@dataclass
class GRPOConfig(PosttrainConfig):
    out_dir: str = "runs/grpo"
    model: str = "runs/dpo/final"
    prompts: str = "task:arithmetic"
    limit: int | None = None
    prompts_per_step: int = 8
    num_generations: int = 8  # G completions per prompt
    max_completion_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_length: int | None = None  # default: the context minus max_completion_tokens
    prompt_overflow: Overflow = "drop"  # or truncate_left (keeps the question's end)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("exact_number")])
    # dapo: the mean over every completion token of the step (all micro-batches and ranks);
    # dr_grpo: the sum over tokens divided by a constant, completions × max_completion_tokens
    loss_type: Literal["dapo", "dr_grpo"] = "dapo"
    scale_rewards: bool = True  # divide advantages by the group std (Dr. GRPO: false)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # DAPO's clip-higher, e.g. 0.28
    beta: float = 0.0  # KL to the reference (k3); 0 loads no reference model
    # the k3 term times the importance ratio, so its gradient estimates KL(π‖ref) under the
    # sampling policy's tokens (TRL's use_bias_correction_kl, on by default there too)
    kl_importance_correction: bool = True
    # token: PPO's ratio per token; sequence: GSPO's (Zheng et al. 2025, Qwen3's RL) — one
    # ratio per completion, the exp of its tokens' mean log-ratio (TRL's
    # importance_sampling_level; GSPO clips it tightly, e.g. epsilon 3e-4, epsilon_high 4e-4)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # correction of the gap between the engine's and the trainer's log-probs (truncated
    # importance sampling, TRL's vllm_importance_sampling_*): each token's loss (or each
    # completion's, sequence_*) weighted by exp(trainer − engine), cut to [min, max]
    # (truncate) or zeroed outside it (mask); none leaves the loss as it was
    sampling_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                 "sequence_mask"] = "none"
    sampling_correction_min: float | None = None
    sampling_correction_max: float | None = 3.0
    # DAPO's dynamic sampling: a step trains on groups whose rewards differ (the only ones
    # with an advantage), drawing more prompts until prompts_per_step such groups are found or
    # dynamic_sampling_rounds generation rounds are spent; a step still short fills up with
    # the rounds' all-equal groups, first drawn first, counted as dynamic/filled_groups
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 3
    # completions cut at max_completion_tokens: filter leaves them out of the loss (TRL's
    # mask_truncated_completions; their rewards still shape their group's advantages);
    # soft_penalty adds DAPO's length penalty to the reward, from 0 down to -1 over the last
    # overlong_buffer tokens of the budget (TRL's get_soft_overlong_punishment)
    overlong: Literal["none", "filter", "soft_penalty"] = "none"
    overlong_buffer: int | None = None  # default: a fifth of max_completion_tokens
    updates_per_batch: int = 1  # optimizer steps on each rollout batch
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rollout.max_staleness and self.sampling_correction == "none":
            raise ConfigError("rollout.max_staleness=1 trains on rollouts sampled by the policy "
                              "one step before: correct for it with sampling_correction "
                              "(token_truncate, as TRL's vLLM rollouts do by default)")
        if self.rollout.url is not None and self.sampling_correction != "none" \
                and self.temperature != 1.0:
            raise ConfigError(f"sampling_correction={self.sampling_correction} with rollout.url "
                              f"and temperature={self.temperature}: a server's log-probs are "
                              "of the distribution before temperature; sample at 1.0 or set "
                              "sampling_correction=none")
        for name in ("prompts_per_step", "num_generations", "updates_per_batch",
                     "max_completion_tokens", "dynamic_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations}: group-relative "
                              "advantages need at least 2 completions per prompt")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"epsilon={self.epsilon} must be in (0, 1)")
        low, high = self.sampling_correction_min, self.sampling_correction_max
        if (low is not None and low < 0) or (high is not None and high <= 0) or (
                low is not None and high is not None and low >= high):
            raise ConfigError(f"sampling_correction_min={low}, sampling_correction_max={high}: "
                              "give 0 <= min < max (either may be null: no bound)")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta} must be >= 0")
        if self.overlong_buffer is None:
            self.overlong_buffer = max(self.max_completion_tokens // 5, 1)
        if not 1 <= self.overlong_buffer <= self.max_completion_tokens:
            raise ConfigError(f"overlong_buffer={self.overlong_buffer} must be between 1 and "
                              f"max_completion_tokens={self.max_completion_tokens}")

    def training_sources(self) -> list[str]:
        return [self.prompts]
