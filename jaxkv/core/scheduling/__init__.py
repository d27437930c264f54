"""Scheduling and pages: what runs in the next step (`scheduler`, its output), the block tables and page pool with the prefix cache (`block_manager`, `page_pool`), and the hybrid pool's seats."""
