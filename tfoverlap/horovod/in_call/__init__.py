"""in_call"""
