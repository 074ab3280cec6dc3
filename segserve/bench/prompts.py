"""The prompts the throughput benchmarks send."""

# Open-ended prompts of similar length: a base model continues them for long
# stretches, and requests additionally ask the server to ignore EOS.
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Here is a short story about a lighthouse keeper who finds a strange map. One morning,",
    "The main differences between a compiler and an interpreter are",
    "In the mountains north of the village, the old road winds past",
    "A practical guide to baking bread at home. First, you will need",
    "The city council met on Tuesday evening to discuss the new train line, and",
    "Photosynthesis is the process by which plants turn sunlight into",
    "When the expedition finally reached the frozen coast, the captain wrote in his journal that",
]
