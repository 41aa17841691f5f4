"""The OTel-free core: the recorder facade over the step lifecycle, module and backward ownership, the collective path
and its one fact, the record pool, trace ids, thread role and failure accounting.
"""
