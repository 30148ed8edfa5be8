"""Rewriters: turn a schedule into GraphDef edits."""
