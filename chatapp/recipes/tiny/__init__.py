"""The recipe of the shipped tiny model: synthetic corpus, BPE tokenizer, training, held-out task evaluation."""
