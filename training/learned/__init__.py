"""What a finished run teaches the next one: a learned id -> bucket map, the Tower
Partitioner's towers, and DMT's placement of tables and towers.
"""
