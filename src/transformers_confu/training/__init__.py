"""Training drafts: CLI, Trainer and arguments, TTT, anchors, data, regeneration, feature cache."""
