"""scaletrain's plan and diagnosis inside the loops people already run.

- `scaletrain.integrations.hf.ScaletrainCallback`: a Hugging Face `Trainer` callback;
- `scaletrain.integrations.lightning.ScaletrainCallback`: a Lightning callback;
- a plain PyTorch loop: `scaletrain.profiling.profile(...)`.

Each framework module imports its framework; this package imports none of them, so
`import scaletrain` never loads transformers, lightning, wandb or mlflow. See
docs/integrations.md.
"""
