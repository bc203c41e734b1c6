"""The authors' evaluation protocol (eval.py --protocol official): its loop (protocol), its scoring and
aggregation rules (rules) and its browsing search with the LLM summariser (browse)."""
