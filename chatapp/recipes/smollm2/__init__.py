"""The recipe that builds the default model (SmolLM2-135M-Instruct as an STT chat model with the calculator)."""
