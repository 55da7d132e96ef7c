"""`fastdllm tune`: the fastest decoding settings within an accuracy budget, for one model and task.

`stats` holds the paired statistics (an exact bound on the accuracy drop of a setting against the
reference on the same problems); `search` the space taken from GenerationConfig's declarations and
the racing search over it; `report` the preset file, the frontier table and its plot.
"""
