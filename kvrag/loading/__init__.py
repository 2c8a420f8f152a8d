"""Loading chunk caches for a fusion: feeds that hand the fusion loop one layer at a time, read and
decoded ahead of use, and the loading controller that plans from measured throughputs.
"""
