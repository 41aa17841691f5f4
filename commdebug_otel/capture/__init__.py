"""Torch-facing capture: module hooks, the dispatch mode, collective interception, op facts, DTensor why; every private
torch touch is in capture/_torch.py.
"""
