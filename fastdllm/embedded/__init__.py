"""The embedded models: their recipe, training, data mixes, and the shipped checkpoints."""
