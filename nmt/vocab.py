"""The special token ids: the tokenizer reserves them, the model pads with PAD_ID and search
starts from BOS_ID and stops at EOS_ID. Defined here only."""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
