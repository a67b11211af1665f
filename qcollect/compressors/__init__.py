"""compressors"""
