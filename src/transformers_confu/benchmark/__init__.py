"""The Spec-Bench style benchmark: speed, quality, questions."""
