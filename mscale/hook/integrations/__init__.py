"""The hook library inside the frameworks users train with: the Hugging Face Trainer callback
(hf), Accelerate (accelerate), Lightning (lightning), what those callbacks share (callbacks), and
the checks inside a compiled graph (compiled). Each imported on its own."""
