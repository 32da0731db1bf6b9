"""The draft model and ConFu's adapter: config, modeling, the [con] adapter, EAGLE-3 format, cards, the target loader."""
