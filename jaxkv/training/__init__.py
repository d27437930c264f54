"""Training draft heads: `jaxkv train-draft` (`train_draft`), its data (`draft_data`: prompts answered, the target's features) and the optax trainer with orbax checkpoints (`trainer`)."""
