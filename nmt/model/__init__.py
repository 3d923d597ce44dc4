"""The model: score functions, encoder, decoders and their assembly, as the papers write them.

Nothing here reads the data layer, training or the commands; the speed paths come in through
the ``FastPaths`` the model is built with (nmt.fast).
"""

from nmt.model.seq2seq import Seq2Seq, build_model, count_parameters

__all__ = ["Seq2Seq", "build_model", "count_parameters"]
