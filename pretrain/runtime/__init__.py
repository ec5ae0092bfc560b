"""The training runtime every stage that trains runs on: pretraining (pretrain/pretraining.py), fine-tuning
(transfer/finetune/stage.py) and detection (transfer/detection/stage.py).

    loop.py            run_training(stage): processes, run lock, DeepSpeed engine, resume, the epoch loop, stop
    task.py            TrainingTask: what a stage's module supplies to the loop (a batch -> a loss)
    checkpoint.py      Checkpointer: save and resume (DeepSpeed shards + trainer state), the run-layout check
    optim.py           optimizers and the schedules of lr and weight decay, arrays indexed by step
    config.py          YAML files and key=value overrides on a dataclass schema, the optim.* / engine.* sections
    distributed.py     process groups and the all-reduces the loop agrees by
    gradient_edits.py  per-parameter clipping and frozen groups
    monitor.py         metrics.jsonl, TensorBoard and the console line
    provenance.py      RUN_DIR/provenance.json: the commit (and local changes), config, packages and machine of every
                       start; the one reading of the checkout's git state
    graceful_stop.py, run_lock.py, divergence.py, exit_status.py: signals, one run per directory, and the errors
                       a run ends with
    atomic_write.py, argument_types.py, config_error.py, cpu_threads.py, memory_reuse.py: what every command uses

It imports nothing of the pretraining feature (the methods, losses, data, models, hard view selection):
tests/test_imports.py fails on such an import.
"""
