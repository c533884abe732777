"""The toolkit of a training script of your own (what the example scripts are built from). PROVISIONAL API.

Not to be confused with :mod:`ds_longseq.trainer`, the Hugging Face ``Trainer`` integration: the two are separate
ways to train and neither imports the other.

PROVISIONAL: names and signatures here may change without a deprecation period; the next issues
extend this package with more metrics, checkpoint and data formats. The stable surface of
ds_longseq is still the top level (``initialize`` / ``enable`` / ``LongSeqConfig``) and
:mod:`ds_longseq.engine`. Not imported by ``import ds_longseq`` (it pulls in tqdm, matplotlib and
transformers' model classes on use); import it as ``ds_longseq.toolkit``.

Modules, one concern each (see each one's "Holds:"):
    data: JSONL records, rows padded to a fixed length, the deterministic micro-batch order.
    packing: several documents per row in the padding-free form (first-fit decreasing).
    tasks: the built-in synthetic tasks and the tiny Llama-shaped model they start from.
    pretrained: a user's checkpoint for --model, a Hugging Face directory or a GGUF file (load_model, load_tokenizer).
    lora: LoRA through PEFT (targets checked, seeded init) and the merge for export.
    quantized: a 4-bit base for QLoRA (--load-in-4bit): its bitsandbytes config, load, bytes, dequantization.
    checkpoint: crash-safe checkpoints (atomic ``latest``), resume, the HF export.
    save_dir: a run's save directory: its lock and id, who owns its directories, what an earlier run left there.
    metrics: metrics.jsonl, the progress bar, peak memory, plots.
    distributed: process-group start-up, config checks against the arguments, collectives.
    args: the shared command-line flags and their checks.
    report_to: --report-to (tensorboard, csv, wandb): the DeepSpeed monitors a run turns on, under --save-dir.
    run: a started run (engine, model, ranks) and its end-of-run export.
    policy: DPO/GRPO's frozen reference, per-token log-probs, preference and rollout data.
    exactness: the check behind ``ds-longseq verify`` (a user's model, stock against its long_seq section).
    faults: fault injection for the package's crash-safety tests (DS_LONGSEQ_FAULT_INJECT; tests only).
"""

from ds_longseq.toolkit.args import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    EXIT_STATUSES,
    DefaultsOnceFormatter,
    DoesNotFit,
    add_common_args,
    check_4bit_args,
    check_args,
    check_lora_args,
    check_model_and_data,
    check_run_args,
    exit_status,
)
from ds_longseq.toolkit.checkpoint import (
    SaveSchedule,
    export_hf,
    gathered_state_dict,
    resume,
    save_checkpoint,
    save_if_due,
    start_or_resume,
    write_latest,
)
from ds_longseq.toolkit.data import (
    JsonlData,
    chat_tokens,
    micro_batch,
    micro_batch_indices,
    pad_id_of,
    pad_row,
    read_jsonl,
    require_keys,
)
from ds_longseq.toolkit.distributed import (
    configure_logging,
    init_process_group,
    mean_over_ranks,
    read_ds_config,
    resolve_or_exit,
    set_learning_rate,
    start_distributed,
    start_resolved,
    to_rank_batch,
)
from ds_longseq.toolkit.lora import add_lora, decoder_linear_names, import_peft, merge_lora, parse_lora_targets
from ds_longseq.toolkit.metrics import MetricsLog, peak_memory_gib, plot_losses, plot_panels
from ds_longseq.toolkit.packing import PackedData, PackStats, first_fit_decreasing, log_packing, pack_jsonl
from ds_longseq.toolkit.policy import (
    PreferenceData,
    Reference,
    RolloutData,
    check_group_size,
    completion_tokens,
    preference_micro_batch,
    rollout_micro_batch,
    token_logprobs,
)
from ds_longseq.toolkit.pretrained import gguf_parts, load_config, load_model, load_tokenizer
from ds_longseq.toolkit.quantized import FourBit, dequantized, import_bitsandbytes, load_4bit, quantized_bytes
from ds_longseq.toolkit.run import Run, finish, setup_run
from ds_longseq.toolkit.tasks import (
    BOS,
    DEFAULT_GROUP_SIZE,
    DOC_TOKENS,
    VOCAB,
    TopicRecallTask,
    build_model,
    copy_example,
    rule_continuation,
    synthetic_group,
    synthetic_pair,
    tiny_llama,
)

__all__ = [
    # data
    "read_jsonl", "require_keys", "pad_id_of", "pad_row", "JsonlData", "chat_tokens", "micro_batch_indices",
    "micro_batch",
    # packing
    "first_fit_decreasing", "PackStats", "PackedData", "pack_jsonl", "log_packing",
    # tasks
    "BOS", "DOC_TOKENS", "VOCAB", "DEFAULT_GROUP_SIZE", "copy_example", "rule_continuation", "synthetic_pair",
    "synthetic_group", "TopicRecallTask", "tiny_llama", "build_model",
    # pretrained checkpoints (a HF directory or a GGUF file)
    "gguf_parts", "load_config", "load_model", "load_tokenizer",
    # lora
    "import_peft", "parse_lora_targets", "decoder_linear_names", "add_lora", "merge_lora",
    # quantized (QLoRA's 4-bit base)
    "FourBit", "import_bitsandbytes", "load_4bit", "quantized_bytes", "dequantized",
    # checkpoint
    "write_latest", "resume", "start_or_resume", "save_checkpoint", "save_if_due", "SaveSchedule",
    "gathered_state_dict", "export_hf",
    # metrics
    "peak_memory_gib", "plot_losses", "plot_panels", "MetricsLog",
    # distributed
    "configure_logging", "init_process_group", "read_ds_config", "resolve_or_exit", "start_distributed",
    "start_resolved", "set_learning_rate",
    "mean_over_ranks", "to_rank_batch",
    # args
    "add_common_args", "DefaultsOnceFormatter", "check_run_args", "check_model_and_data", "check_lora_args",
    "check_4bit_args",
    "check_args", "EXIT_OK", "EXIT_DOES_NOT_FIT", "EXIT_BAD_INPUT", "EXIT_STATUSES", "DoesNotFit", "exit_status",
    # run
    "Run", "setup_run", "finish",
    # policy
    "Reference", "token_logprobs", "PreferenceData", "preference_micro_batch", "RolloutData", "rollout_micro_batch",
    "check_group_size", "completion_tokens",
]
