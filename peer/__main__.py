from peer.cli import main

main()
